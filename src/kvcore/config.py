"""Frozen, validated configuration records: the model's (from config.json) and the engine's."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcore.config_deepseek import (
    STRICT_FAMILIES,
    MLAConfig,
    MoEConfig,
    parse_deepseek,
    unknown_keys,
)
from kvcore.config_rope import RopeScaling as RopeScaling  # re-exported: the model reads it here
from kvcore.config_speculative import SpeculativeConfig
from kvcore.config_tiers import TierConfig

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
KV_CACHE_DTYPES = ("auto", "fp32", "fp16", "bf16", "fp8", "int4")


class ConfigError(ValueError):
    """A config.json that kvcore cannot serve: unsupported, missing or invalid field."""


class ParamError(ValueError):
    """A request parameter out of range: `param` names it as data (the service's 400 carries it
    without parsing the message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[ParamError], tuple[str, str]]:
        # picklable with its param: a cluster replica's refusal crosses a process boundary
        return ParamError, (self.param, str(self))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama", "mistral", "qwen2", "qwen3", "deepseek_v2" or "deepseek_v3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # MLA: every head has its own K/V after decompression (= num_heads)
    head_dim: int  # MLA: the query/key head (qk_nope_head_dim + qk_rope_head_dim)
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    sliding_window: int | None = None  # every layer attends to at most this many keys
    o_proj_bias: bool = False  # Llama's attention_bias also gives o_proj a bias; Qwen2's does not
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's dtype, as config.json names it
    qk_norm: bool = False  # RMSNorm of every q and k head before rotation (Qwen3)
    mla: MLAConfig | None = None  # multi-head latent attention (DeepSeek-V2/V3)
    moe: MoEConfig | None = None  # DeepSeek MoE FFN from layer moe.first_k_dense_replace on

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ConfigError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def kv_layout(self) -> tuple[int, int, bool]:
        """(KV heads, head width, K and V share one array) of the paged cache: MLA caches one
        "KV head" of kv_lora_rank + qk_rope_head_dim per token that is both K and V."""
        if self.mla is not None:
            return 1, self.mla.cache_width, True
        return self.num_kv_heads, self.head_dim, False

    @property
    def rope_dim(self) -> int:
        """Dimensions each rotated head has: the rope part of an MLA head, else the head."""
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any],
                  generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            raise ConfigError(
                f"unsupported architecture {archs or model_type!r}; kvcore serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"config.json is missing the field {key!r}")
            return cfg[key]

        if arch in STRICT_FAMILIES:
            unknown = unknown_keys(cfg, arch)
            if unknown:
                raise ConfigError(f"config.json field(s) kvcore does not know for {arch}: "
                                  f"{', '.join(unknown)}")
        mla = moe = None
        if arch.startswith("deepseek"):
            try:
                mla, moe = parse_deepseek(cfg, arch)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        head_dim = cfg.get("head_dim") or (
            hidden // heads if isinstance(heads, int) and heads else 0)
        if mla is not None:
            head_dim = mla.qk_head_dim
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"unsupported hidden_act {act!r} (kvcore: silu)")
        if cfg.get("mlp_bias"):
            raise ConfigError("unsupported mlp_bias true (kvcore: bias-free MLP)")
        window = cfg.get("sliding_window")
        if arch in ("qwen2", "qwen3"):
            if cfg.get("use_sliding_window"):
                # Qwen slides only on layers >= max_window_layers; kvcore windows all or none
                raise ConfigError(f"unsupported use_sliding_window true for {arch}")
            window = None  # Qwen configs carry a window they do not use
        elif arch != "mistral":
            window = None
        layer_types = set(cfg.get("layer_types") or ())
        if window is not None and "full_attention" in layer_types:
            raise ConfigError(f"unsupported mix of layer_types {sorted(layer_types)}")
        if window is None and layer_types - {"full_attention"}:
            raise ConfigError(f"unsupported layer_types {sorted(layer_types)} (kvcore: "
                              f"full_attention)")
        qkv_bias = arch == "qwen2" or bool(cfg.get("attention_bias", False))
        # transformers 5 writes rope_theta and the scaling together under rope_parameters
        rope_params = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        gen = generation or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),))
        bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
        return cls(
            architecture=arch,
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            sliding_window=window,
            o_proj_bias=arch != "qwen2" and qkv_bias,
            rope_scaling=_rope_scaling(cfg.get("rope_scaling") or rope_params),
            qk_norm=arch == "qwen3",
            mla=mla,
            moe=moe,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path / 'config.json'}: {e}") from e
        gen_path = path / "generation_config.json"
        try:
            generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {gen_path}: {e}") from e
        return cls.from_dict(cfg, generation)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ConfigError(f"unsupported rope_scaling type {kind!r} (kvcore: linear, llama3, "
                          f"yarn)")
    if not isinstance(raw.get("factor"), int | float) or raw["factor"] <= 0:
        raise ConfigError(f"rope_scaling {kind} needs a positive factor, got {raw.get('factor')!r}")
    return RopeScaling(
        rope_type=kind,
        factor=float(raw["factor"]),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        **(_yarn_fields(raw) if kind == "yarn" else {}),
    )


def _yarn_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(raw.get("original_max_position_embeddings"), int):
        raise ConfigError("rope_scaling yarn needs original_max_position_embeddings")

    def optional(key: str) -> float | None:
        return None if raw.get(key) is None else float(raw[key])

    return {"beta_fast": float(raw.get("beta_fast") or 32.0),
            "beta_slow": float(raw.get("beta_slow") or 1.0),
            "mscale": optional("mscale"), "mscale_all_dim": optional("mscale_all_dim"),
            "attention_factor": optional("attention_factor"),
            "truncate": bool(raw.get("truncate", True))}


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: size the pool from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes for K/V of all layers; None: a device default
    cache_dtype: str = "auto"  # "auto" = fp16 (CPU and GPU); or fp32/fp16/bf16/fp8/int4
    enable_prefix_caching: bool = True
    # int4: the fp16 window in tokens, rounded up to whole blocks (a super-block): a query row
    # reads its own super-block in fp16, every earlier block sealed (cache/int4_window.py)
    int4_window_tokens: int = 32

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.cache_dtype!r}")
        window = self.int4_window_tokens
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"int4_window_tokens must be an integer >= 0, "
                             f"got {self.int4_window_tokens!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 256  # running sequences at most
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str  # an HF-style directory
    device: str = "auto"  # "auto", "cpu" or "cuda"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    enforce_eager: bool = False  # cuda: no CUDA graphs for decode steps (every step eager)
    # schedule step N+1 while the device runs step N (vLLM's async scheduling); None: on where
    # the device runs asynchronously (cuda), off on the CPU (a synchronous forward: no overlap
    # to gain, and a sequence that stops would compute one token more). Outputs are identical.
    async_scheduling: bool | None = None
    speculative: SpeculativeConfig | None = None  # speculative decoding (None: off)
    # weights in memory (vLLM's --quantization): "none" fp32, "int8" / "q4" quantized (CPU);
    # "auto": a model converted from a GGUF keeps its own blocks on the CPU, else fp32
    quantization: str = "auto"
    tiers: TierConfig = field(default_factory=TierConfig)  # KV tiers behind the pool (off)

    def __post_init__(self) -> None:
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None (parse JSON with "
                             f"SpeculativeConfig.parse), got {self.speculative!r}")
        if not isinstance(self.tiers, TierConfig):
            raise ValueError(f"tiers must be a TierConfig, got {self.tiers!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.quantization not in ("auto", "none", "int8", "q4"):
            raise ValueError(f"quantization must be auto, none, int8 or q4, "
                             f"got {self.quantization!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, "
                             f"got {self.async_scheduling!r}")

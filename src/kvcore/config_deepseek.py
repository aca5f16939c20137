"""DeepSeek-V2/V3 config.json: multi-head latent attention (MLA) and MoE records, and the keys that
the strict families (Qwen3, DeepSeek) may carry: any other key fails at load, named."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# keys every Hugging Face config.json may carry that do not change the forward pass
_COMMON_KEYS = frozenset({
    "architectures", "model_type", "auto_map", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
    "attention_dropout", "tie_word_embeddings", "hidden_act", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "attention_bias", "head_dim", "_name_or_path", "output_attentions", "output_hidden_states",
    "return_dict", "chunk_size_feed_forward", "id2label", "label2id", "problem_type",
    "tokenizer_class", "is_encoder_decoder", "tf_legacy_loss", "use_bfloat16", "mlp_bias",
    "pretraining_tp",  # a training-time slicing of the projections; the forward is the same
})
_FAMILY_KEYS = {
    "qwen3": frozenset({"use_sliding_window", "sliding_window", "max_window_layers",
                        "layer_types"}),
    "deepseek_v2": frozenset({
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
        "routed_scaling_factor", "topk_method", "scoring_func", "n_group", "topk_group",
        "first_k_dense_replace", "norm_topk_prob", "moe_layer_freq",
        "qk_head_dim",  # transformers writes qk_nope_head_dim + qk_rope_head_dim (checked)
        # training-only: auxiliary balance loss, expert-parallel degree, router logits output
        "aux_loss_alpha", "seq_aux", "ep_size", "output_router_logits", "router_aux_loss_coef",
    }),
}
# V3 adds the rope layout switch and the multi-token-prediction layers (not run when serving)
_FAMILY_KEYS["deepseek_v3"] = _FAMILY_KEYS["deepseek_v2"] | {"rope_interleave",
                                                             "num_nextn_predict_layers"}
STRICT_FAMILIES = frozenset(_FAMILY_KEYS)


def unknown_keys(cfg: dict[str, Any], family: str) -> list[str]:
    """The config.json keys of a strict family that kvcore does not know, sorted."""
    return sorted(set(cfg) - _COMMON_KEYS - _FAMILY_KEYS[family])


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention: per token one latent (kv_lora_rank) and one rotated key part
    (qk_rope_head_dim) shared by every head are cached; per-head K and V are the latent times
    kv_b_proj."""

    kv_lora_rank: int  # width of the normalized latent
    qk_nope_head_dim: int  # per-head key/query part without rotation (from the latent)
    qk_rope_head_dim: int  # rotated part, one key per token for all heads
    v_head_dim: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    rope_interleave: bool  # rotary pairs (2i, 2i + 1), DeepSeek's layout, not halves

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def cache_width(self) -> int:
        """Elements cached per token and layer: the latent and the rotated key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The DeepSeek MoE FFN: shared experts on every token plus top-k routed experts."""

    num_experts: int  # n_routed_experts
    num_shared_experts: int
    num_experts_per_tok: int
    intermediate_size: int  # moe_intermediate_size, per expert
    routed_scaling_factor: float
    scoring_func: str  # "softmax" (V2) or "sigmoid" (V3, with e_score_correction_bias)
    topk_method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    num_groups: int  # n_group: experts fall into this many equal groups
    topk_group: int  # groups a token may route into
    first_k_dense_replace: int  # layers before this one use the dense MLP
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "intermediate_size", "num_groups",
                     "topk_group"):
            _positive(name, getattr(self, name))
        if self.num_shared_experts < 0 or self.first_k_dense_replace < 0:
            raise ValueError("n_shared_experts and first_k_dense_replace must be >= 0")
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of "
                             f"n_group ({self.num_groups})")
        if self.topk_group > self.num_groups:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group "
                             f"({self.num_groups})")
        reachable = self.topk_group * (self.num_experts // self.num_groups)
        if self.topk_method == "greedy":
            reachable = self.num_experts
        if self.num_experts_per_tok > reachable:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                             f"{reachable} experts a token can reach")

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    @property
    def has_score_bias(self) -> bool:
        """V3's noaux_tc routing adds e_score_correction_bias to the scores that choose."""
        return self.topk_method == "noaux_tc"


# the routing each architecture implements (as transformers does): anything else is refused
_ROUTING = {"deepseek_v2": ("softmax", ("greedy", "group_limited_greedy")),
            "deepseek_v3": ("sigmoid", ("noaux_tc",))}


def parse_deepseek(cfg: dict[str, Any], arch: str) -> tuple[MLAConfig, MoEConfig]:
    """MLA and MoE records of a DeepSeek config.json; ValueError naming an unsupported field."""
    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"config.json is missing the field {key!r}")
        return cfg[key]

    for key, allowed in (("attention_bias", False), ("mlp_bias", False), ("moe_layer_freq", 1)):
        if cfg.get(key, allowed) != allowed:
            raise ValueError(f"unsupported {key} {cfg[key]!r} for {arch} (kvcore: {allowed!r})")
    mla = MLAConfig(
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=need("qk_nope_head_dim"),
        qk_rope_head_dim=need("qk_rope_head_dim"),
        v_head_dim=need("v_head_dim"),
        q_lora_rank=cfg.get("q_lora_rank"),
        # V2 always rotates interleaved pairs; V3 unless rope_interleave is false
        rope_interleave=arch == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
    )
    if cfg.get("qk_head_dim", mla.qk_head_dim) != mla.qk_head_dim:
        raise ValueError(f"qk_head_dim {cfg['qk_head_dim']!r} is not qk_nope_head_dim + "
                         f"qk_rope_head_dim ({mla.qk_head_dim})")
    scoring, methods = _ROUTING[arch]
    scoring_func = cfg.get("scoring_func", scoring)
    if scoring_func != scoring:
        raise ValueError(f"unsupported scoring_func {scoring_func!r} for {arch} "
                         f"(kvcore: {scoring!r})")
    topk_method = cfg.get("topk_method", methods[0])
    if topk_method not in methods:
        raise ValueError(f"unsupported topk_method {topk_method!r} for {arch} "
                         f"(kvcore: {', '.join(methods)})")
    norm_topk_prob = bool(cfg.get("norm_topk_prob", arch == "deepseek_v3"))
    if norm_topk_prob and arch == "deepseek_v2":
        # transformers' V2 router ignores it; DeepSeek's own code then skips the scaling factor
        raise ValueError("unsupported norm_topk_prob true for deepseek_v2")
    moe = MoEConfig(
        num_experts=need("n_routed_experts"),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        num_experts_per_tok=need("num_experts_per_tok"),
        intermediate_size=need("moe_intermediate_size"),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        scoring_func=scoring_func,
        topk_method=topk_method,
        num_groups=int(cfg.get("n_group") or 1),
        topk_group=int(cfg.get("topk_group") or 1),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
        norm_topk_prob=norm_topk_prob,
    )
    return mla, moe


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")

"""Tiny random-weight DeepSeek-V2 / V2-Lite / V3 checkpoints (published tensor names, one tensor
per expert) with the byte-level tokenizer of tiny_model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model import BatchInput, LlamaModel
from tiny_model import write_tokenizer

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32, "beta_slow": 1}


def tiny_deepseek_config(kind: str = "v2", **overrides: Any) -> dict[str, Any]:
    """v2: q_lora, grouped softmax routing; v2_lite: no q_lora, greedy routing; v3: sigmoid
    routing with correction bias and group-limited choice. 3 layers (the first dense), hidden 64,
    4 heads, latent 32 + rope 8, 8 experts (top 3), yarn rope with DeepSeek's mscale."""
    if kind not in ("v2", "v2_lite", "v3"):
        raise ValueError(f"kind must be v2, v2_lite or v3, got {kind!r}")
    v3 = kind == "v3"
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 3 + 256, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "float32",
        "attention_bias": False, "attention_dropout": 0.0,
        "q_lora_rank": None if kind == "v2_lite" else 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
        "n_routed_experts": 8, "n_shared_experts": 2 if not v3 else 1,
        "num_experts_per_tok": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5 if v3 else 1.5,
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": {"v2": "group_limited_greedy", "v2_lite": "greedy", "v3": "noaux_tc"}[kind],
        "n_group": 1 if kind == "v2_lite" else 4, "topk_group": 1 if kind == "v2_lite" else 2,
        "norm_topk_prob": v3,
        # V3's published mscale and mscale_all_dim are equal (cos/sin factor 1): differ here
        "rope_scaling": _YARN | ({"mscale": 1.0, "mscale_all_dim": 0.8} if v3 else
                                 {"mscale": 0.707, "mscale_all_dim": 0.707}),
    }
    if v3:
        cfg["rope_interleave"] = True
    cfg |= overrides
    return cfg


def tiny_deepseek_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    r, dn, dr, dv = (cfg["kv_lora_rank"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                     cfg["v_head_dim"])
    q_lora = cfg["q_lora_rank"]

    def normal(*shape: int, std: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)

    def mlp(prefix: str, inter: int) -> dict[str, np.ndarray]:
        return {prefix + "gate_proj.weight": normal(inter, hidden),
                prefix + "up_proj.weight": normal(inter, hidden),
                prefix + "down_proj.weight": normal(hidden, inter)}

    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, std=0.5),
         "model.norm.weight": norm_weight(hidden),
         "lm_head.weight": normal(cfg["vocab_size"], hidden, std=0.1)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w |= {p + "input_layernorm.weight": norm_weight(hidden),
              p + "post_attention_layernorm.weight": norm_weight(hidden),
              a + "kv_a_proj_with_mqa.weight": normal(r + dr, hidden, std=0.15),
              a + "kv_a_layernorm.weight": norm_weight(r),
              a + "kv_b_proj.weight": normal(heads * (dn + dv), r, std=0.15),
              a + "o_proj.weight": normal(hidden, heads * dv)}
        if q_lora is None:
            w[a + "q_proj.weight"] = normal(heads * (dn + dr), hidden, std=0.15)
        else:
            w |= {a + "q_a_proj.weight": normal(q_lora, hidden, std=0.15),
                  a + "q_a_layernorm.weight": norm_weight(q_lora),
                  a + "q_b_proj.weight": normal(heads * (dn + dr), q_lora, std=0.15)}
        m = p + "mlp."
        if i < cfg["first_k_dense_replace"]:
            w |= mlp(m, cfg["intermediate_size"])
            continue
        # a decisive router: well-separated expert scores, so float rounding never flips a choice
        w[m + "gate.weight"] = normal(cfg["n_routed_experts"], hidden, std=0.5)
        if cfg["topk_method"] == "noaux_tc":
            w[m + "gate.e_score_correction_bias"] = normal(cfg["n_routed_experts"], std=0.2)
        for e in range(cfg["n_routed_experts"]):
            w |= mlp(f"{m}experts.{e}.", cfg["moe_intermediate_size"])
        if cfg["n_shared_experts"]:
            w |= mlp(m + "shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    return w


def make_tiny_deepseek(path: str | Path, kind: str = "v2", seed: int = 0,
                       **overrides: Any) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_deepseek_config(kind, **overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tiny_deepseek_weights(cfg, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out)
    return out


def mla_steps(model: LlamaModel, model_dir: Path, cache_dtype: str,
              device: str = "cpu") -> list[np.ndarray]:
    """Two sequences over shuffled blocks: a prompt in two chunks beside a shorter prompt, then
    decode steps; the (2, vocab) logits of every step."""
    c = ModelConfig.from_dir(model_dir)
    heads, width, shared = c.kv_layout
    cache = KVCache(c.num_layers, 16, 4, heads, width, cache_dtype, device, shared_kv=shared)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, c.vocab_size, size=n).tolist() for n in (11, 5)]
    tables = [[3, 9, 0, 12, 5], [7, 2, 14]]
    steps = [([seqs[0][:6], seqs[1]], [0, 0]), ([seqs[0][6:], [41]], [6, 5])]
    steps += [([[17 + i], [23 + i]], [11 + i, 6 + i]) for i in range(3)]
    return [model.forward(BatchInput.build(chunks, computed, tables, 4), cache)
            for chunks, computed in steps]

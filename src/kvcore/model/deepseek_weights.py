"""The tensors of a DeepSeek-V2/V3 checkpoint (HF names, per-expert layout) and their shapes."""

from __future__ import annotations

import re

from kvcore.config import ModelConfig

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def deepseek_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the MLA + MoE forward reads, with its shape."""
    c, mla, moe = config, config.mla, config.moe
    assert mla is not None and moe is not None
    hidden, heads = c.hidden_size, c.num_heads
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            a + "kv_a_proj_with_mqa.weight": (mla.cache_width, hidden),
            a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            a + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                     mla.kv_lora_rank),
            a + "o_proj.weight": (hidden, heads * mla.v_head_dim),
        }
        if mla.q_lora_rank is None:
            shapes[a + "q_proj.weight"] = (heads * mla.qk_head_dim, hidden)
        else:
            shapes |= {a + "q_a_proj.weight": (mla.q_lora_rank, hidden),
                       a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                       a + "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank)}
        m = p + "mlp."
        if not moe.is_moe_layer(i):
            shapes |= _mlp_shapes(m, c.intermediate_size, hidden)
            continue
        shapes[m + "gate.weight"] = (moe.num_experts, hidden)
        if moe.has_score_bias:
            shapes[m + "gate.e_score_correction_bias"] = (moe.num_experts,)
        for e in range(moe.num_experts):
            shapes |= _mlp_shapes(f"{m}experts.{e}.", moe.intermediate_size, hidden)
        if moe.num_shared_experts:
            shapes |= _mlp_shapes(m + "shared_experts.",
                                  moe.intermediate_size * moe.num_shared_experts, hidden)
    return shapes


def is_unused_deepseek_tensor(name: str, config: ModelConfig) -> bool:
    """DeepSeek-V3 checkpoints carry multi-token-prediction layers after the last decoder layer
    (num_nextn_predict_layers); serving does not run them, so they are not read."""
    match = _LAYER_RE.match(name)
    return (config.architecture == "deepseek_v3" and match is not None
            and int(match.group(1)) >= config.num_layers)


def _mlp_shapes(prefix: str, inter: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden),
            prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}

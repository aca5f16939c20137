"""Write a tiny-but-wide random-weight DeepSeek-V2-Lite-shaped checkpoint for benchmarks.

The attention is V2-Lite's at full width (16 heads, latent 512 + rope 64, q/k nope 128, v 128,
hidden 2048, no q_lora) so that the absorbed and decompressed MLA forms are timed at a real
shape; there are only 2 layers (one dense, one MoE with 8 small experts) and a byte vocabulary,
so the checkpoint stays small (about 0.3 GB fp32).

    .venv/bin/python tools/make_mla_model.py DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 2048, "intermediate_size": 4096, "moe_intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 259, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "float32", "attention_bias": False,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
}


def weights(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    r, rope, nope, v = (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"],
                        cfg["v_head_dim"])

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(
            np.float32)

    def mlp(prefix: str, inter: int) -> dict[str, np.ndarray]:
        return {prefix + "gate_proj.weight": normal(inter, hidden),
                prefix + "up_proj.weight": normal(inter, hidden),
                prefix + "down_proj.weight": normal(hidden, inter)}

    ones = np.ones
    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden),
         "model.norm.weight": ones(hidden, np.float32),
         "lm_head.weight": normal(cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w |= {p + "input_layernorm.weight": ones(hidden, np.float32),
              p + "post_attention_layernorm.weight": ones(hidden, np.float32),
              a + "q_proj.weight": normal(heads * (nope + rope), hidden),
              a + "kv_a_proj_with_mqa.weight": normal(r + rope, hidden),
              a + "kv_a_layernorm.weight": ones(r, np.float32),
              a + "kv_b_proj.weight": normal(heads * (nope + v), r),
              a + "o_proj.weight": normal(hidden, heads * v)}
        if i < cfg["first_k_dense_replace"]:
            w |= mlp(m, cfg["intermediate_size"])
            continue
        w[m + "gate.weight"] = normal(cfg["n_routed_experts"], hidden)
        for e in range(cfg["n_routed_experts"]):
            w |= mlp(f"{m}experts.{e}.", cfg["moe_intermediate_size"])
        w |= mlp(m + "shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    return w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    out = parser.parse_args().dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(weights(CONFIG, np.random.default_rng(0)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""config.json of published checkpoints, written down from their model cards' files: DeepSeek-V2,
DeepSeek-V2-Lite, DeepSeek-V3 (auto_map left out) and Qwen3-8B."""

from __future__ import annotations

from typing import Any

_DEEPSEEK_COMMON: dict[str, Any] = {
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "hidden_act": "silu", "initializer_range": 0.02, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_layer_freq": 1, "pretraining_tp": 1,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "seq_aux": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "v_head_dim": 128,
}
_V2_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"}

DEEPSEEK_V2: dict[str, Any] = _DEEPSEEK_COMMON | {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "n_group": 8, "n_routed_experts": 160, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 128, "num_experts_per_tok": 6, "num_hidden_layers": 60,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "rope_scaling": _V2_YARN,
    "routed_scaling_factor": 16.0, "scoring_func": "softmax", "topk_group": 3,
    "topk_method": "group_limited_greedy", "transformers_version": "4.39.3",
    "vocab_size": 102400,
}
DEEPSEEK_V2_LITE: dict[str, Any] = _DEEPSEEK_COMMON | {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "rope_scaling": _V2_YARN,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "topk_group": 1,
    "topk_method": "greedy", "transformers_version": "4.33.1", "vocab_size": 102400,
}
DEEPSEEK_V3: dict[str, Any] = _DEEPSEEK_COMMON | {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
    "topk_method": "noaux_tc", "transformers_version": "4.33.1", "vocab_size": 129280,
}
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

"""ModelConfig from HF config.json files (Llama 2/3, Mistral, Qwen2, SmolLM2) and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcore.config import ConfigError, ModelConfig, RopeScaling

LLAMA2_7B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "float16", "rope_scaling": None,
}
LLAMA31_8B: dict[str, Any] = LLAMA2_7B | {
    "intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "vocab_size": 128256, "rope_theta": 500000.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
MISTRAL_7B: dict[str, Any] = LLAMA2_7B | {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "intermediate_size": 14336,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
}
QWEN2_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
    "max_window_layers": 21, "tie_word_embeddings": True, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
}
SMOLLM2_135M: dict[str, Any] = LLAMA2_7B | {
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_hidden_layers": 30, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "vocab_size": 49152,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def test_llama2() -> None:
    c = ModelConfig.from_dict(LLAMA2_7B)
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama", 32, 4096, 32, 32)
    assert (c.head_dim, c.intermediate_size, c.vocab_size) == (128, 11008, 32000)
    assert (c.rms_norm_eps, c.rope_theta, c.max_position_embeddings) == (1e-5, 10000.0, 4096)
    assert c.sliding_window is None and c.rope_scaling is None and not c.tie_word_embeddings
    assert not c.attention_bias and not c.o_proj_bias
    assert (c.bos_token_id, c.eos_token_ids, c.torch_dtype) == (1, (2,), "float16")


def test_llama3_rope_scaling_and_eos_list() -> None:
    c = ModelConfig.from_dict(LLAMA31_8B)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert c.rope_theta == 500000.0 and c.num_kv_heads == 8
    assert c.eos_token_ids == (128001, 128008, 128009) and c.bos_token_id == 128000


def test_transformers5_rope_parameters() -> None:
    cfg = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = dict(LLAMA31_8B["rope_scaling"], rope_theta=500000.0)
    c = ModelConfig.from_dict(cfg)
    assert c.rope_theta == 500000.0 and c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0,
                                                                      8192)
    plain = ModelConfig.from_dict(LLAMA2_7B | {"rope_parameters": {"rope_type": "default",
                                                                   "rope_theta": 250.0}})
    assert plain.rope_theta == 250.0 and plain.rope_scaling is None


def test_linear_rope_scaling_old_key() -> None:
    c = ModelConfig.from_dict(LLAMA2_7B | {"rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_scaling is not None
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor) == ("linear", 2.0)


def test_mistral_sliding_window() -> None:
    c = ModelConfig.from_dict(MISTRAL_7B)
    assert c.architecture == "mistral" and c.sliding_window == 4096
    assert ModelConfig.from_dict(MISTRAL_7B | {"sliding_window": None}).sliding_window is None


def test_qwen2_bias_and_unused_window() -> None:
    c = ModelConfig.from_dict(QWEN2_05B)
    assert c.architecture == "qwen2" and c.attention_bias and not c.o_proj_bias
    assert c.sliding_window is None and c.tie_word_embeddings and c.head_dim == 64
    with pytest.raises(ConfigError, match="use_sliding_window"):
        ModelConfig.from_dict(QWEN2_05B | {"use_sliding_window": True})


def test_llama_attention_bias_covers_o_proj() -> None:
    c = ModelConfig.from_dict(LLAMA2_7B | {"attention_bias": True})
    assert c.attention_bias and c.o_proj_bias


def test_smollm2_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_135M))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 0]}))
    c = ModelConfig.from_dir(tmp_path)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 9, 3, 64)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.vocab_size == 49152
    assert c.eos_token_ids == (2, 0)  # generation_config.json wins over config.json


def test_explicit_head_dim() -> None:
    c = ModelConfig.from_dict(LLAMA2_7B | {"head_dim": 64})
    assert c.head_dim == 64 and c.num_heads == 32


@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "num_hidden_layers",
                                   "intermediate_size", "vocab_size", "max_position_embeddings"])
def test_missing_field_is_named(field: str) -> None:
    cfg = {k: v for k, v in LLAMA2_7B.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"num_key_value_heads": 5}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_scaling type 'longrope'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn needs original_max_position"),
    ({"rope_scaling": {"rope_type": "linear"}}, "positive factor"),
    ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_theta": -1.0}, "rope_theta"),
])
def test_invalid_configs_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(LLAMA2_7B | change)


def test_mistral_window_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelConfig.from_dict(MISTRAL_7B | {"sliding_window": 0})


def test_unreadable_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    (tmp_path / "generation_config.json").write_text("[1,")
    with pytest.raises(ConfigError, match="generation_config.json"):
        ModelConfig.from_dir(tmp_path)

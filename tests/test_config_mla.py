"""Qwen3 and DeepSeek config.json: parsed fields, strict keys, unsupported values named, and the
planner's MLA figures for the published DeepSeek-V2, V2-Lite and V3 configs, checked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvcore.cli import main
from kvcore.config import ConfigError, ModelConfig
from kvcore.planner import full_kv_bytes_per_token, model_bytes_per_token, plan_for_model
from published_configs import DEEPSEEK_V2, DEEPSEEK_V2_LITE, DEEPSEEK_V3, QWEN3_8B

V3_SERVABLE = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}


def test_published_deepseek_configs_parse() -> None:
    v2 = ModelConfig.from_dict(DEEPSEEK_V2)
    assert v2.architecture == "deepseek_v2" and v2.mla is not None and v2.moe is not None
    assert (v2.mla.q_lora_rank, v2.mla.kv_lora_rank, v2.mla.cache_width) == (1536, 512, 576)
    assert v2.mla.rope_interleave and v2.head_dim == 192 and v2.num_kv_heads == 128
    assert (v2.moe.num_experts, v2.moe.num_experts_per_tok, v2.moe.topk_method,
            v2.moe.num_groups, v2.moe.topk_group) == (160, 6, "group_limited_greedy", 8, 3)
    assert v2.moe.first_k_dense_replace == 1 and not v2.moe.is_moe_layer(0)
    lite = ModelConfig.from_dict(DEEPSEEK_V2_LITE)
    assert lite.mla is not None and lite.mla.q_lora_rank is None
    assert lite.moe is not None and lite.moe.topk_method == "greedy"
    v3 = ModelConfig.from_dict(V3_SERVABLE)
    assert v3.moe is not None and v3.moe.scoring_func == "sigmoid" and v3.moe.has_score_bias
    assert v3.moe.norm_topk_prob and v3.moe.routed_scaling_factor == 2.5
    scaling = v3.rope_scaling
    assert scaling is not None and scaling.rope_type == "yarn" and scaling.factor == 40
    assert scaling.cos_sin_factor == 1.0  # mscale == mscale_all_dim
    assert scaling.softmax_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert v3.kv_layout == (1, 576, True)


def test_published_qwen3_config_parses() -> None:
    c = ModelConfig.from_dict(QWEN3_8B)
    assert (c.architecture, c.qk_norm, c.head_dim, c.num_kv_heads) == ("qwen3", True, 128, 8)
    assert c.sliding_window is None and c.mla is None and c.kv_layout == (8, 128, False)
    assert model_bytes_per_token(c, "bf16") == 2 * 36 * 8 * 128 * 2  # the GQA formula


@pytest.mark.parametrize("cfg,layers,heads", [(DEEPSEEK_V2, 60, 128),
                                              (DEEPSEEK_V2_LITE, 27, 16),
                                              (V3_SERVABLE, 61, 128)])
def test_mla_bytes_per_token_by_hand(cfg: dict[str, Any], layers: int, heads: int) -> None:
    c = ModelConfig.from_dict(cfg)
    # layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes
    assert model_bytes_per_token(c, "bf16") == layers * 576 * 2
    assert model_bytes_per_token(c, "fp8") == layers * 576
    # full per-head K (128 + 64) and V (128) of every head
    assert full_kv_bytes_per_token(layers, heads, 192, 128, "bf16") == layers * heads * 320 * 2
    p = plan_for_model(c, "bf16", context=32768, memory=64 * 2**30)
    assert p.bytes_per_sequence == layers * 576 * 2 * 32768
    assert p.max_concurrent_sequences == 64 * 2**30 // (layers * 576 * 2 * 16) // 2048


def test_v3_figures_of_the_issue() -> None:
    """61 x 576 x 2 = 70,272 bytes per token against 4.77 MiB for full K/V: 71x less."""
    c = ModelConfig.from_dict(V3_SERVABLE)
    assert model_bytes_per_token(c, "bf16") == 70_272
    full = full_kv_bytes_per_token(61, 128, 192, 128, "bf16")
    assert full == 4_997_120 and round(full / 70_272, 1) == 71.1


def test_plan_cli_on_published_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvcore plan --model config.json` knows MLA even where kvcore cannot load the checkpoint
    (V3's fp8 block-quantized weights)."""
    for name, cfg, per_token, ratio in (("v2", DEEPSEEK_V2, 69_120, 71.11),
                                        ("v2_lite", DEEPSEEK_V2_LITE, 31_104, 8.89),
                                        ("v3", DEEPSEEK_V3, 70_272, 71.11)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(cfg))
        assert main(["plan", "--model", str(path), "--dtype", "bf16", "--context", "32768",
                     "--memory", "64GiB", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["bytes_per_token"] == per_token and out["shared_kv"] is True
        assert out["mla_ratio"] == ratio
        assert main(["plan", "--model", str(path), "--context", "32768"]) == 0
        text = capsys.readouterr().out
        assert "one latent K/V of 576" in text and f"MLA caches {ratio}x less" in text


@pytest.mark.parametrize("change,message", [
    ({"kv_lora_rank": None}, "missing the field 'kv_lora_rank'"),
    ({"frobnicate": 1}, "does not know for deepseek_v2: frobnicate"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid' for deepseek_v2"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' for deepseek_v2"),
    ({"norm_topk_prob": True}, "norm_topk_prob true for deepseek_v2"),
    ({"n_group": 7}, "multiple of n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 61}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be even"),
])
def test_bad_deepseek_configs_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(DEEPSEEK_V2 | change)


def test_v3_quantized_checkpoint_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="quantization_config"):
        ModelConfig.from_dict(DEEPSEEK_V3)


@pytest.mark.parametrize("change,message", [
    ({"use_sliding_window": True}, "use_sliding_window true for qwen3"),
    ({"layer_types": ["sliding_attention"] * 36}, "layer_types"),
    ({"partial_rotary_factor": 0.5}, "does not know for qwen3: partial_rotary_factor"),
])
def test_bad_qwen3_configs_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(QWEN3_8B | change)

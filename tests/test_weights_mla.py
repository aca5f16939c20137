"""MLA checkpoints that do not match their config fail at load naming the tensor (and both shapes),
with nothing loaded; the shared latent K/V cache: one array per layer, copy-on-write, fp8."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model import WeightsError, load_model
from kvcore.model.weights import Checkpoint, check_checkpoint
from test_forward_transformers import _rel_err, paged_logits
from tiny_deepseek import make_tiny_deepseek, tiny_deepseek_config, tiny_deepseek_weights


def _rewrite(model_dir: Path, weights: dict[str, np.ndarray]) -> None:
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def test_a_missing_expert_is_named(tmp_path: Path) -> None:
    model_dir = make_tiny_deepseek(tmp_path, "v3")
    weights = tiny_deepseek_weights(tiny_deepseek_config("v3"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    _rewrite(model_dir, weights)
    with pytest.raises(WeightsError, match=r"missing 1 tensor\(s\): "
                                           r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(model_dir)


def test_a_wrong_latent_width_names_the_tensor_and_both_shapes(tmp_path: Path) -> None:
    model_dir = make_tiny_deepseek(tmp_path, "v2")
    weights = tiny_deepseek_weights(tiny_deepseek_config("v2"))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    weights[name] = np.zeros((36, 64), np.float32)  # latent 28 + rope 8, config: 32 + 8
    _rewrite(model_dir, weights)
    with pytest.raises(WeightsError, match=rf"'{name}' has shape \(36, 64\), config.json "
                                           rf"implies \(40, 64\)"):
        load_model(model_dir)


def test_the_whole_checkpoint_is_checked_before_any_tensor_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_tiny_deepseek(tmp_path, "v2_lite")
    weights = tiny_deepseek_weights(tiny_deepseek_config("v2_lite"))
    # the last tensor in load order is the wrong one
    weights["model.layers.2.mlp.shared_experts.down_proj.weight"] = np.zeros((64, 3), np.float32)
    _rewrite(model_dir, weights)
    reads: list[str] = []
    original = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, n: reads.append(n) or original(self, n))
    with pytest.raises(WeightsError, match="shared_experts.down_proj"):
        load_model(model_dir)
    assert reads == []


def test_v3_multi_token_prediction_layers_are_not_read(tmp_path: Path) -> None:
    model_dir = make_tiny_deepseek(tmp_path, "v3", num_nextn_predict_layers=1)
    weights = tiny_deepseek_weights(tiny_deepseek_config("v3"))
    weights["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)  # the MTP layer
    _rewrite(model_dir, weights)
    config = ModelConfig.from_dir(model_dir)
    check_checkpoint(Checkpoint(model_dir), config)  # no "unexpected tensor"


def test_shared_kv_cache_is_one_array_per_layer() -> None:
    cache = KVCache(3, 10, 4, 1, 40, shared_kv=True)
    assert cache.value_caches is cache.key_caches
    assert cache.num_bytes == 3 * 10 * 4 * 40 * 4
    cache.key_caches[1][2] = np.random.default_rng(0).standard_normal((4, 1, 40))
    cache.copy_blocks([(2, 7)])
    np.testing.assert_array_equal(cache.key_caches[1][7], cache.key_caches[1][2])
    with pytest.raises(ValueError, match="v_scales must be None with shared_kv"):
        KVCache(3, 10, 4, 1, 40, shared_kv=True, v_scales=[1.0] * 3)


def test_fp8_latent_cache_stays_close(tmp_path: Path) -> None:
    """An fp8 (e4m3) latent cache: the same forward, logits within fp8's rounding."""
    model = load_model(make_tiny_deepseek(tmp_path, "v2", seed=2))
    seq = [int(t) for t in np.random.default_rng(3).integers(0, 259, 30)]
    exact = paged_logits(model, [seq], prefill=20)[0]
    fp8 = paged_logits(model, [seq], prefill=20, cache_dtype="fp8")[0]
    assert 0 < _rel_err(fp8, exact) < 5e-2

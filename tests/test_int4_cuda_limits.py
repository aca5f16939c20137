"""A model the CUDA int4 kernels do not compile for is refused up front with an int4 cache on
cuda, the error naming the value, before any int4 array is allocated; the CPU takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.config import ModelConfig
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.engine.setup import int4_group
from kvcore.model import load_model
from tiny_model import make_tiny_model


def model_config(**fields: int) -> ModelConfig:
    base = dict(architecture="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                head_dim=64, intermediate_size=128, vocab_size=259, rms_norm_eps=1e-5,
                rope_theta=1e4, max_position_embeddings=256, tie_word_embeddings=False,
                attention_bias=False)
    return ModelConfig(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "block_size", "message"), [
    ({"head_dim": 256}, 8, r"head_dim 256: an int4 KV cache on cuda needs head_dim in \(64, "),
    ({"num_heads": 66}, 8, "66 query heads over 2 KV heads: an int4 KV cache on cuda needs a "
     "GQA group"),
    ({}, 4, "block_size 4: an int4 KV cache on cuda needs a power of two >= 8"),
    ({}, 24, "block_size 24: an int4 KV cache on cuda needs a power of two >= 8"),
])
def test_cuda_refuses_an_int4_cache_it_cannot_launch(fields: dict[str, int], block_size: int,
                                                     message: str) -> None:
    config = model_config(**fields)
    with pytest.raises(ValueError, match=message):
        int4_group(config, block_size, "cuda")
    assert int4_group(config, block_size, "cpu") == 32  # the CPU kernels take it


def test_engine_on_cuda_refuses_head_dim_256_before_allocating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine's set-up on cuda (the fp16 model loads on the CPU here): the error
    names head_dim before any int4 array is made."""
    import kvcore.device
    import kvcore.engine.engine as engine_module
    import kvcore.engine.setup as setup

    wide = make_tiny_model(tmp_path / "tiny_d256", seed=3, head_dim=256)
    monkeypatch.setattr(kvcore.device, "cuda_available", lambda: True)
    monkeypatch.setattr(engine_module, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(setup, "load_model", lambda m, device="cpu", weight_format="none":
                        load_model(m, "cpu", weight_format, half=True))
    made: list[object] = []
    monkeypatch.setattr(setup, "KVCache", lambda *a, **k: made.append(a))
    config = engine_config(str(wide), block_size=8, num_blocks=16, cache_dtype="int4",
                           enforce_eager=True)
    with pytest.raises(ValueError, match="head_dim 256: an int4 KV cache on cuda"):
        Engine(config)
    assert not made


def test_value_group_of_8_is_refused_on_cuda() -> None:
    """A value group of 8 would not compile (kv_int4_stage.cuh's static_assert): refused with
    the group named."""
    from kvcore.kernels.cuda.attention_kv_int4 import check_int4_limits

    with pytest.raises(ValueError, match="int4 group 8: an int4 KV cache on cuda needs a "
                                         "multiple of 16"):
        check_int4_limits(16, 8, 2, 128, 8)
    check_int4_limits(16, 8, 2, 128, 16)

"""The fused CPU decode step (kvcore.model.cpu_decode over kvcore.kernels.cpu.decode_step)
against the per-op path and the NumPy reference: bit-identical logits and KV caches to the
per-op path for every weight format and the KV dtypes it takes, whatever the thread count;
close to the NumPy reference (the oracle); and the batches it leaves to the per-op path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvcore.cache.kv_cache import KVCache
from kvcore.kernels.cpu import jit
from kvcore.kernels.cpu import threads as threads_module
from kvcore.model import BatchInput, load_model

pytestmark = pytest.mark.skipif(not jit.active(), reason="the fused step is compiled")
BLOCK = 4


def _steps(model, rng: np.random.Generator, lens: list[int]) -> list[BatchInput]:  # type: ignore[no-untyped-def]
    """A prefill of every sequence (over 16 rows: the per-op path), then three decode steps of
    1-3 rows each (and one of a 2-row verify chunk beside a decode row)."""
    vocab = model.config.vocab_size
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(lens))]
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in lens]
    steps = [BatchInput.build(prompts, [0] * len(lens), tables, BLOCK)]
    done = list(lens)
    for chunk in ([1] * len(lens), [2] + [1] * (len(lens) - 1), [1] * len(lens)):
        feed = [[int(t) for t in rng.integers(0, vocab, n)] for n in chunk]
        steps.append(BatchInput.build(feed, done, tables, BLOCK,
                                      [len(f) for f in feed]))
        done = [d + n for d, n in zip(done, chunk, strict=True)]
    return steps


def _run(model, steps: list[BatchInput], cache_dtype: str, fused: bool):  # type: ignore[no-untyped-def]
    c = model.config
    cache = KVCache(c.num_layers, 64, BLOCK, c.num_kv_heads, c.head_dim, cache_dtype)
    saved = model.fused
    if not fused:
        model.fused = None
    try:
        logits = [model.forward(step, cache) for step in steps]
    finally:
        model.fused = saved
    return logits, cache


@pytest.mark.parametrize("cache_dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("weights", ["none", "int8", "q4"])
def test_fused_decode_matches_the_per_op_path_bit_for_bit(tiny_model_dir: Path, weights: str,
                                                          cache_dtype: str) -> None:
    model = load_model(tiny_model_dir, weight_format=weights)
    assert model.fused is not None
    steps = _steps(model, np.random.default_rng(1), [9, 3, 14])
    assert all(model.fused.takes(s.num_tokens, KVCache(1, 1, BLOCK, 1, 8, cache_dtype))
               for s in steps[1:])
    fused, fused_cache = _run(model, steps, cache_dtype, True)
    per_op, per_op_cache = _run(model, steps, cache_dtype, False)
    for a, b in zip(fused, per_op, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(fused_cache.key_stack.view(np.uint8),
                                  per_op_cache.key_stack.view(np.uint8))
    np.testing.assert_array_equal(fused_cache.value_stack.view(np.uint8),
                                  per_op_cache.value_stack.view(np.uint8))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_decode_bits_do_not_depend_on_the_thread_count(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    """One thread alone runs every phase (any thread may take any chunk); more threads split
    the chunks differently and give the same bits."""
    model = load_model(tiny_model_dir, weight_format="q4")
    steps = _steps(model, np.random.default_rng(2), [5, 11])
    expected, _ = _run(model, steps, "fp16", False)
    monkeypatch.setattr(threads_module, "_threads", threads)
    got, _ = _run(model, steps, "fp16", True)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_fused_decode_is_close_to_the_numpy_reference(tiny_model_dir: Path) -> None:
    """The oracle: the same steps with numba off (NumPy attention, NumPy element-wise ops,
    OpenBLAS GEMMs) agree to float32 rounding."""
    model = load_model(tiny_model_dir)
    steps = _steps(model, np.random.default_rng(3), [7, 12, 2])
    fused, _ = _run(model, steps, "fp32", True)
    jit.set_enabled(False)
    try:
        reference, _ = _run(model, steps, "fp32", False)
    finally:
        jit.set_enabled(True)
    for a, b in zip(fused, reference, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


def test_what_the_fused_step_leaves_to_the_per_op_path(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert model.fused is not None
    c = model.config
    cache = KVCache(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, "fp32")
    assert model.fused.takes(16, cache) and not model.fused.takes(17, cache)
    assert not model.fused.takes(0, cache)
    for dtype in ("fp8", "int4"):
        other = KVCache(c.num_layers, 8, BLOCK, c.num_kv_heads, c.head_dim, dtype,
                        num_window_slots=4 if dtype == "int4" else None, window_tokens=8)
        assert not model.fused.takes(1, other)


def test_kernel_threads_are_sized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_module, "_threads", 0)
    monkeypatch.setenv("KVCORE_NUM_THREADS", "3")
    assert threads_module.num_threads() == 3
    monkeypatch.setenv("KVCORE_NUM_THREADS", "1")  # read at start-up only
    assert threads_module.num_threads() == 3
    monkeypatch.setenv("KVCORE_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="KVCORE_NUM_THREADS"):
        threads_module.threads_from_environment()

"""The compiled CPU paged attention (numba) vs a float64 dense computation, and vs the NumPy
kernel, on fresh random problems: GQA ratios, block sizes, windows, cache dtypes, contexts up to
4,097 tokens, shuffled block tables with padding, released window blocks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import structlog

from kvcore.kernels import cpu
from kvcore.kernels.cpu import jit
from kvcore.kernels.cpu import threads as threads_module

pytestmark = pytest.mark.skipif(jit.compiled() is None, reason="numba is not installed")

BF16, FP8 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)
# cache dtype -> k/v scale (the reference reads back what the cache stores: stored * scale)
DTYPES = {np.dtype(np.float32): 1.0, np.dtype(np.float16): 1.0, BF16: 1.0, FP8: 0.05}
TOL = 3e-5


def problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
            num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            dtype: np.dtype, scale: float) -> tuple[tuple, list[np.ndarray], list[np.ndarray]]:
    """A mixed batch over a shuffled paged cache of `dtype` (spare blocks hold garbage, tables
    padded with -1): (kernel arguments, float64 keys and values as the cache holds them (stored
    x scale, so the comparison tests the kernel, not the rounding to `dtype`), per sequence)."""
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks) + 2
    perm = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (num_blocks, bs, Hkv, D)
    k_cache = (rng.standard_normal(shape) * 5).astype(dtype)  # garbage that must not be read
    v_cache = (rng.standard_normal(shape) * 5).astype(dtype)
    tables = np.full((len(context_lens), max(blocks) + 2), -1, np.int32)  # (S, max_blocks)
    keys, values, used = [], [], 0
    for s, ctx in enumerate(context_lens):
        tables[s, :blocks[s]] = perm[used:used + blocks[s]]
        used += blocks[s]
        k = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32) * 2
        v = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32)
        pos = np.arange(ctx)
        slots = tables[s, pos // block_size].astype(np.int64) * block_size + pos % block_size
        cpu.reshape_and_cache(k, v, k_cache, v_cache, slots, scale, scale)
        flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)  # (slots, Hkv, D)
        flat_v = v_cache.reshape(-1, num_kv_heads, head_dim)
        keys.append(flat_k[slots].astype(np.float64) * scale)
        values.append(flat_v[slots].astype(np.float64) * scale)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(np.float32)
    args = (query, k_cache, v_cache, tables, np.array(context_lens, np.int32), qsl)
    return args, keys, values


def dense(query: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
          window: int | None) -> np.ndarray:
    """float64 causal attention of the q_len queries that end a len(keys)-token sequence."""
    q_len, num_heads, head_dim = query.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = np.repeat(keys, group, axis=1)  # (ctx, H, D)
    v = np.repeat(values, group, axis=1)
    scores = np.einsum("qhd,khd->hqk", query.astype(np.float64), k) * scale  # (H, q, ctx)
    q_pos = np.arange(ctx - q_len, ctx)[:, None]
    k_pos = np.arange(ctx)[None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
    scores = np.where(masked, -np.inf, scores)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", w / w.sum(axis=-1, keepdims=True), v)


def check(out: np.ndarray, args: tuple, keys: list, values: list, scale: float,
          window: int | None, tol: float) -> None:
    query, qsl = args[0], args[5]
    assert out.shape == query.shape and out.dtype == np.float32
    for s in range(len(keys)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        np.testing.assert_allclose(out[rows], dense(query[rows], keys[s], values[s], scale,
                                                    window), atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(24))
def test_compiled_matches_dense(seed: int) -> None:
    """Seeded sweep: every case draws its heads, block size, window, dtype and batch."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = [(9, 3), (4, 1), (2, 2), (8, 2), (6, 3)][seed % 5]
    block_size = [1, 3, 4, 16][seed % 4]
    window = [None, 1, 7, 33, None, 100][seed % 6]
    dtype = list(DTYPES)[seed % 4]
    head_dim = [8, 64, 16][seed % 3]
    context_lens = [int(c) for c in rng.integers(1, 120, int(rng.integers(1, 6)))]
    q_lens = [int(rng.choice([1, rng.integers(1, c + 1), c])) for c in context_lens]
    kv_scale = DTYPES[dtype]
    args, keys, values = problem(rng, context_lens, q_lens, num_heads, num_kv_heads, head_dim,
                                 block_size, dtype, kv_scale)
    out = jit.paged_attention(*args, 0.3, window, kv_scale, kv_scale)
    check(out, args, keys, values, 0.3, window, TOL)


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("heads", [(9, 3), (2, 2), (8, 2), (5, 1)])
def test_register_tiles_match_dense(block_size: int, heads: tuple[int, int]) -> None:
    """The 16-lane tiles (head_dim in 16s; scores 8 keys x two vectors of a KV head at a time,
    a lone vector paired with itself; values four vectors at a time) on blocks of 8 and 32
    keys, decode tokens and prefill chunks, odd and even GQA groups."""
    rng = np.random.default_rng(block_size + heads[0])
    args, keys, values = problem(rng, [70, 33, 8], [1, 20, 8], *heads, 32, block_size,
                                 np.dtype(np.float16), 1.0)
    out = jit.paged_attention(*args, 0.2, None, 1.0, 1.0)
    check(out, args, keys, values, 0.2, None, TOL)


@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("window", [None, 1000])
def test_long_contexts_split_keys_and_merge(monkeypatch: pytest.MonkeyPatch, threads: str,
                                            window: int | None) -> None:
    """A batch of one at 4,097 tokens: its keys are split into pieces (one item each, so every
    thread has work) and merged; beside it a long prefill chunk over cached context."""
    monkeypatch.setattr(threads_module, "_threads", int(threads))
    rng = np.random.default_rng(int(threads))
    args, keys, values = problem(rng, [4097, 700], [1, 300], 9, 3, 64, 16,
                                 np.dtype(np.float32), 1.0)
    out = jit.paged_attention(*args, 0.125, window, 1.0, 1.0)
    check(out, args, keys, values, 0.125, window, TOL)
    # the dispatcher: the long chunk through NumPy, the decode token compiled
    check(cpu.paged_attention(*args, 0.125, window), args, keys, values, 0.125, window, TOL)


def test_compiled_and_numpy_kernels_agree() -> None:
    """Both CPU paths on one mixed batch with a window and released blocks (-1 in the table)."""
    rng = np.random.default_rng(5)
    args, keys, values = problem(rng, [53, 90, 17, 64], [1, 20, 17, 1], 6, 2, 32, 4,
                                 np.dtype(np.float16), 1.0)
    tables = args[3]
    tables[1, :(90 - 20 - 9) // 4] = -1  # wholly behind the chunk's first window
    tables[0, :(53 - 9) // 4] = -1
    compiled = jit.paged_attention(*args, 0.2, 9, 1.0, 1.0)
    jit.set_enabled(False)
    try:
        assert jit.path_name() == "numpy (reference)"
        numpy_out = cpu.paged_attention(*args, 0.2, 9)
    finally:
        jit.set_enabled(True)
    np.testing.assert_allclose(compiled, numpy_out, atol=2e-5, rtol=2e-5)
    check(compiled, args, keys, values, 0.2, 9, TOL)


@pytest.mark.parametrize("dtype,bits", [(np.dtype(np.float16), np.uint16), (BF16, np.uint16),
                                        (FP8, np.uint8)])
def test_every_bit_pattern_reads_as_numpy_converts_it(dtype: np.dtype, bits: type) -> None:
    """The in-kernel conversions (bf16 by a shift, fp16 widened as halves, fp8 from its bits)
    on every stored value: normals, subnormals, zeros of both signs, infinities and NaNs."""
    from kvcore.kernels.cpu.attention_blocks import load_block

    raw = np.arange(np.iinfo(bits).max + 1, dtype=np.int64).astype(bits)  # every pattern
    cache = raw.reshape(1, 1, 1, -1)  # one block of one slot
    out = np.empty((1, 1, raw.size), np.float32)  # (bs, Hkv, D)
    mode = jit._cache_mode(raw.view(dtype).reshape(cache.shape))[0]  # type: ignore[index]
    load_block(cache, 0, mode, out)
    expected = raw.view(dtype).astype(np.float32)
    np.testing.assert_array_equal(out.reshape(-1), expected)  # NaN where NaN
    finite = ~np.isnan(expected)  # and the sign of every zero
    np.testing.assert_array_equal(out.reshape(-1)[finite].view(np.uint32),
                                  expected[finite].view(np.uint32))


def test_bad_block_ids_raise_before_any_read() -> None:
    rng = np.random.default_rng(2)
    args, _, _ = problem(rng, [9, 14], [1, 1], 4, 2, 8, 4, np.dtype(np.float32), 1.0)
    tables = args[3].copy()
    tables[1, 0] = args[1].shape[0]  # one past the last block
    with pytest.raises(ValueError, match="block id outside the cache"):
        cpu.paged_attention(args[0], args[1], args[2], tables, *args[4:], 0.3)


def test_warm_up_logs_the_path() -> None:
    with structlog.testing.capture_logs() as logs:
        seconds = jit.warm_up_cpu_kernels("bf16")
        jit.set_enabled(False)
        try:
            jit.warm_up_cpu_kernels("fp32")
        finally:
            jit.set_enabled(True)
    assert seconds >= 0
    assert [(e["event"], e["path"]) for e in logs] == [
        ("CPU paged attention", "numba (compiled)"), ("CPU paged attention", "numpy (reference)")]
    with pytest.raises(ValueError, match="cache_dtype must be one of"):
        jit.warm_up_cpu_kernels("int8")


def test_numba_cache_goes_under_kvcore_home_when_the_package_is_read_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVCORE_HOME", str(tmp_path))
    monkeypatch.setattr(jit.os, "access", lambda path, mode: False)
    jit._cache_dir()
    assert jit.os.environ["NUMBA_CACHE_DIR"] == str(tmp_path / "numba-cache")
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/elsewhere")  # a value already set wins
    jit._cache_dir()
    assert jit.os.environ["NUMBA_CACHE_DIR"] == "/elsewhere"


def test_without_numba_the_numpy_kernel_runs_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import kvcore.kernels.cpu

    monkeypatch.setattr(jit, "_compiled", None)
    monkeypatch.setattr(jit, "_load_error", None)
    monkeypatch.delattr(kvcore.kernels.cpu, "attention")
    monkeypatch.setitem(sys.modules, "kvcore.kernels.cpu.attention", None)  # import fails
    with structlog.testing.capture_logs() as logs:
        assert jit.compiled() is None and not jit.active()
        jit.warm_up_cpu_kernels("fp32")
    assert logs[0]["log_level"] == "warning" and "NumPy kernels" in logs[0]["event"]
    assert logs[1]["path"] == "numpy (reference)"
    rng = np.random.default_rng(4)
    args, keys, values = problem(rng, [30, 7], [1, 7], 4, 2, 8, 4, np.dtype(np.float32), 1.0)
    check(cpu.paged_attention(*args, 0.3), args, keys, values, 0.3, None, TOL)

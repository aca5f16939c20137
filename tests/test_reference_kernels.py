"""NumPy reference kernels vs an independent float64 dense computation on fresh random inputs."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import RopeScaling
from kvcore.kernels import cpu as reference
from kvcore.kernels.cpu import attention_reference
from kvcore.kernels.cpu import threads as threads_module

EXAMPLES = int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "30"))


def _scatter_sequences(rng: np.random.Generator, context_lens: list[int], block_size: int,
                       num_kv_heads: int, head_dim: int, cache_dtype: np.dtype,
                       scale: float = 1.0):
    """Random K/V per sequence written into shuffled blocks; returns dense copies and tables."""
    blocks_needed = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_needed) + 3  # spare blocks stay zero and must never be read
    perm = rng.permutation(num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = np.zeros(shape, cache_dtype), np.zeros(shape, cache_dtype)
    tables = np.full((len(context_lens), max(blocks_needed) + 1), -1, np.int32)
    keys, values, used = [], [], 0
    for s, ctx in enumerate(context_lens):
        tables[s, :blocks_needed[s]] = perm[used:used + blocks_needed[s]]
        used += blocks_needed[s]
        k = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32) * 2
        v = rng.standard_normal((ctx, num_kv_heads, head_dim)).astype(np.float32)
        slots = np.array([tables[s, p // block_size] * block_size + p % block_size
                          for p in range(ctx)], dtype=np.int64)
        reference.reshape_and_cache(k, v, k_cache, v_cache, slots, scale, scale)
        keys.append(k.astype(np.float64))
        values.append(v.astype(np.float64))
    return k_cache, v_cache, tables, keys, values


def _dense_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, ctx: int,
                     scale: float, window: int | None) -> np.ndarray:
    """float64 causal attention of q_len queries at the end of a ctx-token sequence."""
    q_len, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = np.zeros(q.shape)
    for i in range(q_len):
        p = ctx - q_len + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(num_heads):
            scores = keys[lo:p + 1, h // group] @ q[i, h].astype(np.float64) * scale
            w = np.exp(scores - scores.max())
            out[i, h] = (w / w.sum()) @ values[lo:p + 1, h // group]
    return out


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       heads=st.sampled_from([(2, 2), (6, 2), (4, 1), (3, 3)]),
       block_size=st.sampled_from([1, 3, 4, 16]),
       window=st.sampled_from([None, 1, 5, 13]),
       num_seqs=st.integers(1, 5))
def test_paged_attention_matches_dense(seed: int, heads: tuple[int, int], block_size: int,
                                       window: int | None, num_seqs: int) -> None:
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = heads
    head_dim = 8
    context_lens = [int(c) for c in rng.integers(1, 40, num_seqs)]
    # a mix of decode tokens (q_len 1), prefill chunks and whole prompts
    q_lens = [int(rng.choice([1, rng.integers(1, c + 1), c])) for c in context_lens]
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, context_lens, block_size, num_kv_heads, head_dim, np.dtype(np.float32))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(np.float32)
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array(context_lens, np.int32), qsl, 0.35, window)
    assert out.shape == query.shape and out.dtype == np.float32
    for s, ctx in enumerate(context_lens):
        expected = _dense_attention(query[qsl[s]:qsl[s + 1]], keys[s], values[s], ctx, 0.35,
                                    window)
        np.testing.assert_allclose(out[qsl[s]:qsl[s + 1]], expected, rtol=1e-4, atol=1e-5)


def test_attention_never_reads_released_blocks() -> None:
    """With a sliding window, blocks wholly before the window may be -1 in the table."""
    rng = np.random.default_rng(7)
    block_size, window, ctx = 4, 6, 23
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, [ctx, ctx], block_size, 2, 8, np.dtype(np.float32))
    tables[:, :(ctx - 2 - window + 1) // block_size] = -1  # released by the cache manager
    query = rng.standard_normal((3, 4, 8)).astype(np.float32)
    qsl = np.array([0, 1, 3], np.int32)  # a decode token, then a 2-token chunk
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array([ctx, ctx], np.int32), qsl, 0.3, window)
    np.testing.assert_allclose(out[:1], _dense_attention(query[:1], keys[0], values[0], ctx,
                                                         0.3, window), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[1:], _dense_attention(query[1:], keys[1], values[1], ctx,
                                                         0.3, window), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,scale,tol", [
    (np.float16, 1.0, 2e-3),
    (ml_dtypes.float8_e4m3fn, 1.0, 0.12),
    (ml_dtypes.float8_e4m3fn, 0.05, 0.12),
    (ml_dtypes.bfloat16, 1.0, 2e-2),
])
def test_low_precision_caches(dtype, scale: float, tol: float) -> None:
    rng = np.random.default_rng(3)
    context_lens, q_lens = [9, 17, 30], [1, 5, 30]
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, context_lens, 4, 2, 16, np.dtype(dtype), scale)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 6, 16)).astype(np.float32) * 0.3
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array(context_lens, np.int32), qsl, 0.25,
                                    k_scale=scale, v_scale=scale)
    for s, ctx in enumerate(context_lens):
        expected = _dense_attention(query[qsl[s]:qsl[s + 1]], keys[s], values[s], ctx, 0.25, None)
        np.testing.assert_allclose(out[qsl[s]:qsl[s + 1]], expected, atol=tol)


def test_fp8_stores_x_over_scale_and_saturates() -> None:
    cache = np.zeros((2, 2, 1, 4), ml_dtypes.float8_e4m3fn)
    key = np.array([[[0.5, -3.0, 96.0, -1000.0]], [[1.0, 2.0, 4.0, 8.0]]], np.float32)
    reference.reshape_and_cache(key, key, cache, cache.copy(), np.array([3, -1]), k_scale=0.5)
    stored = cache.astype(np.float32)
    np.testing.assert_array_equal(stored[1, 1, 0], [1.0, -6.0, 192.0, -448.0])
    assert not stored[0].any() and not stored[1, 0].any()  # -1 slot skipped, nothing else written


def test_reshape_and_cache_writes_exact_slots() -> None:
    rng = np.random.default_rng(11)
    key = rng.standard_normal((5, 2, 4)).astype(np.float32)
    value = rng.standard_normal((5, 2, 4)).astype(np.float32)
    k_cache, v_cache = np.zeros((4, 3, 2, 4), np.float32), np.zeros((4, 3, 2, 4), np.float32)
    slots = np.array([11, 0, -1, 4, 7])
    reference.reshape_and_cache(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots):
        if slot >= 0:
            np.testing.assert_array_equal(k_cache[slot // 3, slot % 3], key[t])
            np.testing.assert_array_equal(v_cache[slot // 3, slot % 3], value[t])
    assert np.count_nonzero(k_cache.reshape(12, -1).any(axis=1)) == 4
    with pytest.raises(ValueError, match="slot 12"):
        reference.reshape_and_cache(key[:1], value[:1], k_cache, v_cache, np.array([12]))


@pytest.mark.parametrize("contiguous_cache", [True, False])
@pytest.mark.parametrize("pad", [False, True])
def test_reshape_and_cache_paths_agree(contiguous_cache: bool, pad: bool) -> None:
    """Every slot valid (flat-row path) or some padding, contiguous caches or strided views of
    a larger array, token-strided keys (a slice of the fused qkv): same bytes as a loop."""
    rng = np.random.default_rng(12)
    qkv = rng.standard_normal((6, 3, 2, 4)).astype(np.float32)
    key, value = qkv[:, 1], qkv[:, 2]  # (6, 2, 4) views, token stride 3 x 2 x 4
    slots = rng.permutation(20)[:6]
    if pad:
        slots[[0, 3]] = -1
    base = rng.standard_normal((5, 4, 2, 2, 4)).astype(np.float32)
    if contiguous_cache:
        k_cache, v_cache = base[:, :, :, 0].copy(), base[:, :, :, 1].copy()
    else:
        k_cache, v_cache = base[:, :, :, 0], base[:, :, :, 1]  # (5, 4, 2, 4) strided views
    expected_k, expected_v = k_cache.copy(), v_cache.copy()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // 4, slot % 4], expected_v[slot // 4, slot % 4] = key[t], value[t]
    reference.reshape_and_cache(key, value, k_cache, v_cache, slots)
    np.testing.assert_array_equal(k_cache, expected_k)
    np.testing.assert_array_equal(v_cache, expected_v)
    reference.reshape_and_cache(key, value, k_cache, v_cache, np.full(6, -1))  # all padding
    reference.reshape_and_cache(key[:0], value[:0], k_cache, v_cache, slots[:0])  # no tokens
    np.testing.assert_array_equal(k_cache, expected_k)
    if not contiguous_cache:
        np.testing.assert_array_equal(base[:, :, :, 0], expected_k)  # written through the view


def test_copy_blocks_all_layers() -> None:
    rng = np.random.default_rng(5)
    ks = [rng.standard_normal((6, 4, 2, 3)).astype(np.float32) for _ in range(3)]
    vs = [rng.standard_normal((6, 4, 2, 3)).astype(np.float32) for _ in range(3)]
    before_k, before_v = [k.copy() for k in ks], [v.copy() for v in vs]
    reference.copy_blocks(ks, vs, np.array([[0, 5], [3, 1]], np.int64))
    for layer in range(3):
        for cache, before in ((ks[layer], before_k[layer]), (vs[layer], before_v[layer])):
            np.testing.assert_array_equal(cache[5], before[0])
            np.testing.assert_array_equal(cache[1], before[3])
            np.testing.assert_array_equal(cache[[0, 2, 3, 4]], before[[0, 2, 3, 4]])
    with pytest.raises(ValueError, match="block id outside"):
        reference.copy_blocks(ks, vs, np.array([[0, 6]], np.int64))


def test_rms_norm_and_silu_and_mul() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 32)).astype(np.float32) * 3
    w = rng.standard_normal(32).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(reference.rms_norm(x, w, 1e-5), expected, rtol=1e-5, atol=1e-6)
    gate, up = x64[:, :16], x64[:, 16:]
    np.testing.assert_allclose(reference.silu_and_mul(x), gate * (1 / (1 + np.exp(-gate))) * up,
                               rtol=1e-5, atol=1e-6)


def test_rope_is_a_rotation_of_half_pairs() -> None:
    """Rotate-half rope == multiplying (x_j + i x_{j+D/2}) by exp(i * pos * inv_freq_j)."""
    rng = np.random.default_rng(4)
    head_dim, positions = 16, np.array([0, 3, 100, 2047])
    x = rng.standard_normal((4, 3, head_dim)).astype(np.float32)
    inv_freq = 1.0 / 10000.0 ** (np.arange(head_dim // 2) * 2 / head_dim)
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(head_dim, 10000.0), 2048)
    out = reference.rope(x, positions, cos, sin)
    z = (x[..., :8] + 1j * x[..., 8:]) * np.exp(1j * positions[:, None, None] * inv_freq)
    np.testing.assert_allclose(out, np.concatenate([z.real, z.imag], axis=-1), atol=2e-5)


def test_rope_scaling_frequencies() -> None:
    base = reference.rope_inv_freq(64, 500000.0)
    linear = reference.rope_inv_freq(64, 500000.0, RopeScaling("linear", 4.0))
    np.testing.assert_allclose(linear, base / 4.0)
    llama3 = reference.rope_inv_freq(64, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
    wavelen = 2 * np.pi / base
    np.testing.assert_allclose(llama3[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high freq
    np.testing.assert_allclose(llama3[wavelen > 8192], base[wavelen > 8192] / 8.0)  # low freq
    mid = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert mid.any() and np.all(llama3[mid] < base[mid]) and np.all(llama3[mid] > base[mid] / 8)


@pytest.mark.parametrize("window", [None, 9, 40])
def test_tiled_long_chunks(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    """Chunks longer than one query tile: causal and window bounds trim keys per tile."""
    monkeypatch.setattr(attention_reference, "TILE_ELEMENTS", 64)  # 16-row tiles
    rng = np.random.default_rng(21)
    context_lens, q_lens = [70, 53, 90], [70, 37, 1]
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, context_lens, 4, 2, 8, np.dtype(np.float32))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 6, 8)).astype(np.float32)
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array(context_lens, np.int32), qsl, 0.4, window)
    for s, ctx in enumerate(context_lens):
        expected = _dense_attention(query[qsl[s]:qsl[s + 1]], keys[s], values[s], ctx, 0.4, window)
        np.testing.assert_allclose(out[qsl[s]:qsl[s + 1]], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("threads,part_keys", [("1", 4096), ("3", 4096), ("2", 24), ("3", 1)])
def test_large_decode_batch_split_over_threads(monkeypatch: pytest.MonkeyPatch, threads: str,
                                               part_keys: int) -> None:
    """Decode tokens sorted by context length into groups of bounded padded keys (part_keys 1:
    a group per sequence), the groups spread over threads; rows come back in batch order."""
    monkeypatch.setattr(threads_module, "_threads", int(threads))
    monkeypatch.setattr(attention_reference, "DECODE_PART_KEYS", part_keys)
    rng = np.random.default_rng(int(threads))
    context_lens = [int(c) for c in rng.integers(1, 50, 40)]
    q_lens = [1] * 37 + context_lens[37:]  # 37 decode tokens and 3 whole prompts
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, context_lens, 4, 2, 8, np.dtype(np.float32))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 4, 8)).astype(np.float32)
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array(context_lens, np.int32), qsl, 0.3, 11)
    for s, ctx in enumerate(context_lens):
        expected = _dense_attention(query[qsl[s]:qsl[s + 1]], keys[s], values[s], ctx, 0.3, 11)
        np.testing.assert_allclose(out[qsl[s]:qsl[s + 1]], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("logit_scale", [0.3, 40.0])
def test_prefill_softmax_with_large_scores(monkeypatch: pytest.MonkeyPatch,
                                           logit_scale: float) -> None:
    """Softmax skips the shift by the row maximum only while every row's maximum is within
    +-60; scores far outside that (scale 40: |score| in the hundreds) take the shifted path and
    must neither overflow nor underflow to 0/0, in prefill tiles and decode tokens alike."""
    monkeypatch.setattr(attention_reference, "TILE_ELEMENTS", 64)  # 16-row tiles
    rng = np.random.default_rng(33)
    context_lens, q_lens = [45, 30, 21, 9], [45, 12, 1, 1]
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, context_lens, 4, 2, 8, np.dtype(np.float32))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 4, 8)).astype(np.float32)
    out = reference.paged_attention(query, k_cache, v_cache, tables,
                                    np.array(context_lens, np.int32), qsl, logit_scale)
    assert np.isfinite(out).all()
    for s, ctx in enumerate(context_lens):
        expected = _dense_attention(query[qsl[s]:qsl[s + 1]], keys[s], values[s], ctx,
                                    logit_scale, None)
        np.testing.assert_allclose(out[qsl[s]:qsl[s + 1]], expected, rtol=1e-4, atol=1e-4)


def _two_decode_sequences(seed: int) -> tuple:
    """Two sequences of 9 and 14 tokens in a shuffled 4-token-block cache, one decode query
    each: (k_cache, v_cache, tables, keys, values, context_lens, query_start_loc, query)."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache, tables, keys, values = _scatter_sequences(
        rng, [9, 14], 4, 2, 8, np.dtype(np.float32))
    query = rng.standard_normal((2, 4, 8)).astype(np.float32)
    return (k_cache, v_cache, tables, keys, values, np.array([9, 14], np.int32),
            np.array([0, 1, 2], np.int32), query)


def test_plan_reuse_follows_in_place_changes() -> None:
    """Layers of one step share an attention plan; arrays changed in place get a new one."""
    k_cache, v_cache, tables, keys, values, ctx, qsl, query = _two_decode_sequences(8)
    reference.paged_attention(query, k_cache, v_cache, tables, ctx, qsl, 0.3)
    # move sequence 1 to other blocks and drop its last token, in the same arrays
    spare = np.setdiff1d(np.arange(k_cache.shape[0]), tables[tables >= 0])[:3]
    for i, block in enumerate(spare):
        k_cache[block], v_cache[block] = k_cache[tables[1, i]], v_cache[tables[1, i]]
    tables[1, :3] = spare
    ctx[1] = 13
    out = reference.paged_attention(query, k_cache, v_cache, tables, ctx, qsl, 0.3)
    np.testing.assert_allclose(out[1:], _dense_attention(query[1:], keys[1][:13], values[1][:13],
                                                         13, 0.3, None), rtol=1e-4, atol=1e-5)


def test_plan_checks_batch_values_on_every_new_plan() -> None:
    """The value checks run when a plan is built: a bad batch after a good one (same shapes,
    whose plan is cached) still raises, and a rejected batch leaves no plan behind."""
    k_cache, v_cache, tables, _, _, ctx, qsl, query = _two_decode_sequences(9)
    rng = np.random.default_rng(10)
    good = reference.paged_attention(query, k_cache, v_cache, tables, ctx, qsl, 0.3)
    too_long = ctx.copy()
    too_long[1] = tables.shape[1] * 4 + 1  # one token beyond the table's blocks
    for _ in range(2):
        with pytest.raises(ValueError, match="context_lens exceed the blocks"):
            reference.paged_attention(query, k_cache, v_cache, tables, too_long, qsl, 0.3)
    query3 = rng.standard_normal((4, 4, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="more query tokens than its context_lens"):
        reference.paged_attention(query3, k_cache, v_cache, tables, np.array([9, 2], np.int32),
                                  np.array([0, 1, 4], np.int32), 0.3)
    np.testing.assert_array_equal(
        reference.paged_attention(query, k_cache, v_cache, tables, ctx, qsl, 0.3), good)


def test_large_inputs_split_by_rows_give_the_same_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads_module, "_threads", 3)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((700, 512)).astype(np.float32)  # above the row-split threshold
    w = rng.standard_normal(512).astype(np.float32)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(
        reference.rms_norm(x, w, 1e-6),
        x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + 1e-6) * w, rtol=1e-5, atol=1e-6)
    gate, up = x64[:, :256], x64[:, 256:]
    np.testing.assert_allclose(reference.silu_and_mul(x), gate / (1 + np.exp(-gate)) * up,
                               rtol=1e-5, atol=1e-6)
    q = x.reshape(700, 8, 64)
    positions = rng.integers(0, 4096, 700)
    cos, sin = reference.rope_cos_sin(reference.rope_inv_freq(64, 10000.0), 4096)
    z = (q[..., :32] + 1j * q[..., 32:]) * np.exp(
        1j * positions[:, None, None] * reference.rope_inv_freq(64, 10000.0))
    np.testing.assert_allclose(reference.rope(q, positions, cos, sin),
                               np.concatenate([z.real, z.imag], axis=-1), atol=5e-5)

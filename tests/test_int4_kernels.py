"""The int4 KV cache's CPU kernels: the numba sealing quantizer is bit-exact with the format's
NumPy reference (kvcore.cache.int4), and the compiled attention, the NumPy attention and a
float64 computation over the dequantized cache agree on fresh random problems, each query row
reading its own super-block from the fp16 window and every earlier block sealed."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.cache import int4
from kvcore.kernels import cpu
from kvcore.kernels.cpu import jit, kv_int4_blocks
from kvcore.kernels.cpu.kv_int4 import Int4Layer

pytestmark = pytest.mark.skipif(jit.compiled() is None, reason="numba is not installed")


def numba_rows(block: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    bs, heads, dim = block.shape
    k_row = np.zeros(kv_int4_blocks.key_row_bytes(bs, heads, dim), np.uint8)
    v_row = np.zeros(kv_int4_blocks.value_row_bytes(bs, heads, dim, group), np.uint8)
    bits = np.ascontiguousarray(block, np.float16).view(np.uint16)
    kv_int4_blocks.quantize_key(bits, k_row)
    kv_int4_blocks.quantize_value(bits, group, v_row)
    return k_row, v_row


def assert_exact(block: np.ndarray, group: int) -> None:
    k_row, v_row = numba_rows(block, group)
    np.testing.assert_array_equal(k_row, int4.quantize_key_block(block))
    np.testing.assert_array_equal(v_row, int4.quantize_value_block(block, group))


def test_row_sizes_match_the_format() -> None:
    for bs, heads, dim, group in ((16, 2, 64, 32), (1, 1, 2, 2), (5, 3, 8, 4)):
        assert kv_int4_blocks.key_row_bytes(bs, heads, dim) == int4.key_row_bytes(bs, heads, dim)
        assert (kv_int4_blocks.value_row_bytes(bs, heads, dim, group)
                == int4.value_row_bytes(bs, heads, dim, group))


def test_every_nibble_value_round_trips() -> None:
    """Values 0..15 (a scale of exactly 1): each code is its own value, in both nibbles."""
    codes = np.arange(16, dtype=np.float16)
    block = np.stack([np.roll(codes, t) for t in range(16)])[:, None, :]  # (16, 1, 16)
    assert_exact(block, 16)
    k_row, v_row = numba_rows(block, 16)
    nibbles = int4._unpack(k_row[:16 * 8].reshape(16, 1, 8))
    np.testing.assert_array_equal(nibbles, block.astype(np.uint8))
    np.testing.assert_array_equal(int4.dequantize_value_block(v_row, 16, 1, 16, 16), block)


def test_zero_scale_and_saturation() -> None:
    """A constant group (scale 0 -> code 0), NaN (-> 0), +-inf and fp16's extremes (-> +-65504)."""
    block = np.full((4, 2, 8), 3.25, np.float16)
    assert_exact(block, 8)
    block[0, 0, 0], block[1, 0, 1], block[2, 1, 2] = np.nan, np.inf, -np.inf
    block[3, 1, 3] = np.float16(65504)
    assert_exact(block, 4)
    k_row, _ = numba_rows(block, 4)
    keys = int4.dequantize_key_block(k_row, 4, 2, 8)
    # saturated, not inf: the decoded extreme is 65504 up to the fp16 scale's rounding
    assert np.isfinite(keys).all() and np.abs(keys).max() < 65504 * 1.001


@pytest.mark.parametrize("seed", range(6))
def test_random_blocks_give_the_reference_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bs, heads, dim = [(16, 2, 64), (4, 1, 8), (32, 4, 128)][seed % 3]
    group = [32, 4, 64][seed % 3]
    magnitude = [1e-3, 1.0, 300.0, 3e4][seed % 4]
    block = np.clip(rng.standard_normal((bs, heads, dim)) * magnitude, -6e4, 6e4)
    block[:, :, 1] = np.clip(block[:, :, 1] + magnitude * 5, -6e4, 6e4)  # an outlier channel
    block = block.astype(np.float16)
    assert_exact(block, group)


def int4_problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
                 heads: int, dim: int, bs: int, group: int, window_blocks: int
                 ) -> tuple[Int4Layer, Int4Layer, np.ndarray, list, list]:
    """Sequences written through reshape_and_cache into window slots, every full block sealed
    (its rows valid) and its slot kept only where some query row reads it in fp16 (its own
    super-block: kvcore.cache.int4_window's rule), the others' slots poisoned with NaN: (K, V,
    tables, and per sequence the float64 keys and values each query row reads, (q_len, ctx,
    Hkv, D) as the rule of positions names them)."""
    num_blocks = sum(-(-c // bs) for c in context_lens) + 2
    perm = rng.permutation(num_blocks)
    shape = (num_blocks, bs, heads, dim)
    window = (rng.standard_normal(shape) * 3).astype(np.float16)  # one slot per block: garbage
    v_window = (rng.standard_normal(shape) * 3).astype(np.float16)
    window_slot = np.arange(num_blocks, dtype=np.int32)
    k_rows = rng.integers(0, 256, (num_blocks, int4.key_row_bytes(bs, heads, dim)), np.uint8)
    v_rows = rng.integers(0, 256, (num_blocks, int4.value_row_bytes(bs, heads, dim, group)),
                          np.uint8)
    k = Int4Layer(k_rows, window, window_slot, True, group, window_blocks)
    v = Int4Layer(v_rows, v_window, window_slot, False, group, window_blocks)
    tables = np.full((len(context_lens), max(-(-c // bs) for c in context_lens) + 1), -1,
                     np.int32)
    used = 0
    for s, ctx in enumerate(context_lens):
        n = -(-ctx // bs)
        tables[s, :n] = perm[used:used + n]
        used += n
        pos = np.arange(ctx)
        slots = tables[s, pos // bs].astype(np.int64) * bs + pos % bs
        cpu.reshape_and_cache(rng.standard_normal((ctx, heads, dim)).astype(np.float32) * 2,
                              rng.standard_normal((ctx, heads, dim)).astype(np.float32), k, v,
                              slots)
        full = tables[s, :ctx // bs].astype(np.int64)
        kv_int4_blocks.seal_blocks(window.view(np.uint16), v_window.view(np.uint16), k_rows, v_rows,
                                   full, window_slot[full].astype(np.int64), group)
    keys, values = [], []
    for s, (ctx, q_len) in enumerate(zip(context_lens, q_lens, strict=True)):
        blocks = tables[s, :-(-ctx // bs)]
        first_own = (ctx - q_len) // bs // window_blocks * window_blocks
        forms = {form: (reference_blocks(k, blocks, form, ctx // bs).reshape(-1, heads, dim)[:ctx],
                        reference_blocks(v, blocks, form, ctx // bs).reshape(-1, heads, dim)[:ctx])
                 for form in ("sealed", "window")}
        row_pos = np.arange(ctx - q_len, ctx)[:, None]  # (q, 1)
        key_block = (np.arange(ctx) // bs)[None, :]  # (1, ctx)
        own = (key_block // window_blocks == row_pos // bs // window_blocks)[..., None, None]
        keys.append(np.where(own, forms["window"][0], forms["sealed"][0]))  # (q, ctx, H, D)
        values.append(np.where(own, forms["window"][1], forms["sealed"][1]))
        for b in blocks[:first_own]:  # no row reads these in fp16: no slot, NaN behind it
            window[window_slot[b]] = v_window[window_slot[b]] = np.nan
            window_slot[b] = -1
    return k, v, tables, keys, values


def reference_blocks(layer: Int4Layer, blocks: np.ndarray, form: str,
                     num_full: int) -> np.ndarray:
    """float64 blocks from their window slots ("window") or through the format's NumPy
    reference dequantizer ("sealed"; the partial last block, past num_full, has no sealed
    form: its slot, which no row reads sealed)."""
    _, bs, heads, dim = layer.shape
    out = []
    for i, b in enumerate(blocks):
        slot = layer.window_slot[b]
        if form == "window" or i >= num_full:
            out.append(layer.window[slot].astype(np.float64))
        elif layer.is_key:
            out.append(int4.dequantize_key_block(layer.rows[b], bs, heads, dim))
        else:
            out.append(int4.dequantize_value_block(layer.rows[b], bs, heads, dim, layer.group))
    return np.stack(out).astype(np.float64)


def dense(query: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float,
          window: int | None) -> np.ndarray:
    """float64 causal attention of the q_len queries that end a sequence; keys and values
    (q_len, ctx, Hkv, D): what each query row reads."""
    q_len, num_heads, _ = query.shape
    ctx, num_kv_heads = keys.shape[1], keys.shape[2]
    k = np.repeat(keys, num_heads // num_kv_heads, axis=2)  # (q, ctx, H, D)
    v = np.repeat(values, num_heads // num_kv_heads, axis=2)
    scores = np.einsum("qhd,qkhd->hqk", query.astype(np.float64), k) * scale  # (H, q, ctx)
    q_pos = np.arange(ctx - q_len, ctx)[:, None]
    k_pos = np.arange(ctx)[None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else False)
    scores = np.where(masked, -np.inf, scores)
    w = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("hqk,qkhd->qhd", w / w.sum(axis=-1, keepdims=True), v)


@pytest.mark.parametrize("seed", range(8))
def test_compiled_numpy_and_float64_agree(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    num_heads, heads = [(4, 2), (6, 3), (2, 2), (8, 1)][seed % 4]
    dim, group = [(16, 8), (64, 32), (8, 8), (128, 64)][seed % 4]
    bs = [4, 16, 1, 8][seed % 4]
    window = [None, 9, None, 40][seed % 4]
    window_blocks = [1, 2, 3, 1][seed % 4] if seed < 4 else [2, 1, 5, 3][seed % 4]
    context_lens = [int(c) for c in rng.integers(1, 90, int(rng.integers(1, 5)))]
    q_lens = [int(rng.choice([1, rng.integers(1, c + 1), c])) for c in context_lens]
    k, v, tables, keys, values = int4_problem(rng, context_lens, q_lens, heads, dim, bs, group,
                                              window_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, dim)).astype(np.float32)
    args = (query, k, v, tables, np.array(context_lens, np.int32), qsl, 0.3, window)
    compiled = jit.paged_attention(*args, 1.0, 1.0)
    reference = cpu._numpy_attention(*args, 1.0, 1.0)
    for s in range(len(context_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        expected = dense(query[rows], keys[s], values[s], 0.3, window)
        np.testing.assert_allclose(compiled[rows], expected, atol=3e-5, rtol=3e-5)
        np.testing.assert_allclose(reference[rows], expected, atol=3e-5, rtol=3e-5)


def test_a_write_into_a_sealed_block_is_refused() -> None:
    rng = np.random.default_rng(3)
    k, v, tables, _, _ = int4_problem(rng, [8], [1], 1, 8, 4, 8, 1)
    sealed = [b for b in tables[0, :2] if k.window_slot[b] < 0]
    if not sealed:
        k.window_slot[tables[0, 0]] = -1
        sealed = [tables[0, 0]]
    rows = np.ones((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=f"block {sealed[0]} is sealed"):
        cpu.reshape_and_cache(rows, rows, k, v, np.array([sealed[0] * 4 + 1]))

"""The int4 attention tiles (kvcore.kernels.cpu.kv_int4_tiles) on single sealed blocks against
float64 over the format's reference dequantizer: scores through the folded key scales and zeros,
weighted values rebuilt per chunk, on GQA groups that leave a lone vector or repeat one, zero
scales (constant channels and groups) and the split channel order's round trip; and whole
attention over default-model shapes mixing sealed and window blocks on both sides of the tiles'
vector limit."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.cache import int4
from kvcore.kernels import cpu
from kvcore.kernels.cpu import jit

pytestmark = pytest.mark.skipif(jit.compiled() is None, reason="numba is not installed")

if jit.compiled() is not None:
    from kvcore.kernels.cpu import kv_int4_tiles

# (num_heads, num_kv_heads, head_dim, block_size, rows): GQA 3 (a lone third vector), MQA 8,
# and one head per KV head (every vector lone)
SHAPES = [(9, 3, 64, 16, 1), (9, 3, 64, 16, 2), (8, 1, 128, 8, 1), (4, 4, 32, 8, 3)]


def split_order(x: np.ndarray) -> np.ndarray:
    """(V, D) -> split order: per 32 channels, the even ones then the odd ones."""
    v, d = x.shape
    chunks = x.reshape(v, d // 32, 16, 2)
    return np.concatenate([chunks[..., 0], chunks[..., 1]], axis=2).reshape(v, d)


def kv_heads(num_vecs: int, num_heads: int, group: int) -> np.ndarray:
    return (np.arange(num_vecs) % num_heads) // group


def test_fits_only_whole_chunks() -> None:
    assert kv_int4_tiles.fits(16, 64, 32) and kv_int4_tiles.fits(8, 128, 64)
    assert not kv_int4_tiles.fits(16, 64, 16)  # a chunk of 32 channels would hold two scales
    assert not kv_int4_tiles.fits(16, 48, 16) and not kv_int4_tiles.fits(4, 64, 32)


def test_split_order_round_trips() -> None:
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 64)
    split = np.empty_like(x)
    kv_int4_tiles.split_channels(x, split)
    np.testing.assert_array_equal(split, split_order(x))
    joined = np.ones_like(x)
    kv_int4_tiles.add_joined(split, joined)
    np.testing.assert_array_equal(joined, x + 1)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "bs", "rows"), SHAPES)
def test_scores_match_float64(num_heads: int, num_kv_heads: int, head_dim: int, bs: int,
                              rows: int) -> None:
    rng = np.random.default_rng(head_dim + rows)
    group = num_heads // num_kv_heads
    keys = (rng.standard_normal((bs, num_kv_heads, head_dim)) * 2 + 3).astype(np.float16)
    keys[:, 0, 5] = 2.5  # a constant channel: scale 0, every code 0
    keys[:, -1, :] = 0.0  # a constant head
    keys[3, 0, 7] = 300.0  # an outlier in one channel
    row = int4.quantize_key_block(keys)
    dequantized = int4.dequantize_key_block(row, bs, num_kv_heads, head_dim).astype(np.float64)
    queries = rng.standard_normal((rows * num_heads, head_dim)).astype(np.float32)  # (V, D)
    split = np.empty_like(queries)
    kv_int4_tiles.split_channels(queries, split)
    params = np.empty((2, num_kv_heads, head_dim), np.float32)
    scaled = np.empty_like(queries)
    offsets = np.empty(queries.shape[0], np.float32)
    kv_int4_tiles.key_queries(split, row, num_heads, group, bs, params, scaled, offsets)
    scores = np.full((queries.shape[0], bs), np.nan, np.float32)  # (V, bs)
    kv_int4_tiles.sealed_scores(scaled, offsets, row, num_heads, group, num_kv_heads, scores)
    heads = kv_heads(queries.shape[0], num_heads, group)
    expected = np.einsum("vd,tvd->vt", queries.astype(np.float64), dequantized[:, heads])
    magnitude = np.einsum("vd,tvd->vt", np.abs(queries), np.abs(dequantized[:, heads]))
    assert (np.abs(scores - expected) <= 1e-6 * magnitude + 1e-6).all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "bs", "rows", "value_group"),
                         [(*shape, g) for shape in SHAPES for g in (32, 64) if shape[2] % g == 0])
def test_values_match_float64(num_heads: int, num_kv_heads: int, head_dim: int, bs: int,
                              rows: int, value_group: int) -> None:
    rng = np.random.default_rng(head_dim * rows + value_group)
    group = num_heads // num_kv_heads
    values = rng.standard_normal((bs, num_kv_heads, head_dim)).astype(np.float16)
    values[2, 0, :value_group] = -1.5  # a constant group: scale 0
    values[5, -1, -1] = 6e4  # an extreme value
    row = int4.quantize_value_block(values, value_group)
    dequantized = int4.dequantize_value_block(row, bs, num_kv_heads, head_dim,
                                              value_group).astype(np.float64)
    num_vecs = rows * num_heads
    probs = rng.random((num_vecs, bs)).astype(np.float32)  # (V, bs)
    probs[:, 1] = 0.0  # a masked key
    start = rng.standard_normal((num_vecs, head_dim)).astype(np.float32)  # what acc held
    acc = split_order(start)
    row_sum = np.ones(num_vecs, np.float32)
    params = np.empty(2 * bs * num_kv_heads * (head_dim // value_group), np.float32)
    kv_int4_tiles.value_params(row, bs * num_kv_heads * head_dim // 2, params.shape[0] // 2,
                               params)
    kv_int4_tiles.sealed_values(probs, row, params, num_heads, group, num_kv_heads, value_group,
                                acc, row_sum)
    out = np.zeros_like(start)
    kv_int4_tiles.add_joined(acc, out)
    heads = kv_heads(num_vecs, num_heads, group)
    expected = start + np.einsum("vt,tvd->vd", probs.astype(np.float64), dequantized[:, heads])
    magnitude = np.abs(start) + np.einsum("vt,tvd->vd", probs, np.abs(dequantized[:, heads]))
    assert (np.abs(out - expected) <= 1e-6 * magnitude + 1e-6).all()
    np.testing.assert_allclose(row_sum, 1 + probs.sum(axis=1), rtol=1e-6)


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_attention_reads_sealed_blocks_by_tiles(sliding_window: int | None) -> None:
    """Default-model shapes (9 heads, 3 KV heads, head_dim 64, blocks of 16, group 32, a
    window of 2 blocks): decode tokens and chunks of 4 and 40 rows (a chunk crossing
    super-blocks: its earlier rows read blocks from the window that its later rows read
    sealed, through the tiles whatever the tile's size)."""
    from test_int4_kernels import dense, int4_problem

    rng = np.random.default_rng(29)
    context_lens = [70, 130, 49, 96]
    q_lens = [1, 4, 40, 1]
    k, v, tables, keys, values = int4_problem(rng, context_lens, q_lens, 3, 64, 16, 32, 2)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), 9, 64)).astype(np.float32)
    args = (query, k, v, tables, np.array(context_lens, np.int32), qsl, 0.125, sliding_window)
    compiled = jit.paged_attention(*args, 1.0, 1.0)
    reference = cpu._numpy_attention(*args, 1.0, 1.0)
    for s in range(len(context_lens)):
        rows = slice(int(qsl[s]), int(qsl[s + 1]))
        expected = dense(query[rows], keys[s], values[s], 0.125, sliding_window)
        np.testing.assert_allclose(compiled[rows], expected, atol=3e-5, rtol=3e-5)
        np.testing.assert_allclose(compiled[rows], reference[rows], atol=2e-5, rtol=2e-5)

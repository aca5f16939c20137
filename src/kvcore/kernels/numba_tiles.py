"""A block's scores and weighted values in 16-lane register tiles (kvcore.kernels.numba_simd),
for head_dim a multiple of 16 (and, for the scores, blocks of a multiple of 8 keys): the
general loops in kvcore.kernels.numba_blocks serve every other shape.

Vectors are a tile's query rows x heads, flat: vector i is query head i % num_heads of row
i // num_heads, and reads KV head (i % num_heads) // group."""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.numba_blocks import FASTMATH
from kvcore.kernels.numba_simd import (
    LANES,
    add,
    load,
    muladd,
    splat,
    store,
    store_halves,
    sums16,
)


@njit(fastmath=FASTMATH, cache=True)
def tile_scores(queries: np.ndarray, keys: np.ndarray, num_heads: int, group: int,
                scores: np.ndarray) -> None:
    """scores (V, bs) = queries (V, D) . keys (bs, Hkv, D), two vectors of one KV head against
    8 keys at a time: 16 independent accumulators over head_dim (each key chunk loaded once
    serves both vectors), then one shuffle tree gives the 16 scores as one vector, its halves
    the two vectors' rows (16 horizontal reductions would cost three times as much). A lone
    vector, the last of its KV head's, pairs with itself."""
    block_size, num_kv_heads, head_dim = keys.shape[0], keys.shape[1], keys.shape[2]
    flat_keys = keys.reshape(keys.size)
    flat_queries = queries.reshape(queries.size)
    stride = num_kv_heads * head_dim  # from one key to the next
    zero = splat(np.float32(0.0))
    i = 0
    while i < queries.shape[0]:
        kv_head = (i % num_heads) // group
        j = i + 1 if i + 1 < queries.shape[0] and (i + 1) % num_heads // group == kv_head else i
        for t in range(0, block_size, LANES // 2):
            k = (t * num_kv_heads + kv_head) * head_dim
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
            b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = zero
            for c in range(0, head_dim, LANES):
                x = load(flat_queries, i * head_dim + c)
                y = load(flat_queries, j * head_dim + c)
                key = load(flat_keys, k + c)
                a0, b0 = muladd(x, key, a0), muladd(y, key, b0)
                key = load(flat_keys, k + c + stride)
                a1, b1 = muladd(x, key, a1), muladd(y, key, b1)
                key = load(flat_keys, k + c + 2 * stride)
                a2, b2 = muladd(x, key, a2), muladd(y, key, b2)
                key = load(flat_keys, k + c + 3 * stride)
                a3, b3 = muladd(x, key, a3), muladd(y, key, b3)
                key = load(flat_keys, k + c + 4 * stride)
                a4, b4 = muladd(x, key, a4), muladd(y, key, b4)
                key = load(flat_keys, k + c + 5 * stride)
                a5, b5 = muladd(x, key, a5), muladd(y, key, b5)
                key = load(flat_keys, k + c + 6 * stride)
                a6, b6 = muladd(x, key, a6), muladd(y, key, b6)
                key = load(flat_keys, k + c + 7 * stride)
                a7, b7 = muladd(x, key, a7), muladd(y, key, b7)
            # lanes 0-7: vector i against keys t..t+7; lanes 8-15: vector j
            store_halves(scores[i], scores[j], t, sums16((a0, a1, a2, a3, a4, a5, a6, a7, b0,
                                                          b1, b2, b3, b4, b5, b6, b7)))
        i = j + 1


@njit(fastmath=FASTMATH, cache=True)
def tile_values(probs: np.ndarray, values: np.ndarray, num_heads: int, group: int,
                acc: np.ndarray, row_sum: np.ndarray) -> None:
    """acc (V, D) += probs (V, bs) @ values (bs, Hkv, D), and row_sum (V,) += probs' rows.
    Up to four vectors of one KV head per pass (a group of fewer repeats its last one), 16
    lanes of head_dim at a time: each value row is loaded once for the four, the accumulators
    stay in registers over the block's keys, even and odd keys in separate ones (eight
    independent chains keep both FMA pipes busy)."""
    block_size, num_kv_heads, head_dim = values.shape[0], values.shape[1], values.shape[2]
    flat_values = values.reshape(values.size)
    stride = num_kv_heads * head_dim
    zero = splat(np.float32(0.0))
    i = 0
    while i < acc.shape[0]:
        kv_head = (i % num_heads) // group
        last = (i // num_heads) * num_heads + (kv_head + 1) * group - 1  # of this KV head
        i0, i1, i2, i3 = i, min(i + 1, last), min(i + 2, last), min(i + 3, last)
        for c in range(0, head_dim, LANES):
            a0, a1, a2, a3 = load(acc[i0], c), load(acc[i1], c), load(acc[i2], c), \
                load(acc[i3], c)
            b0 = b1 = b2 = b3 = zero
            v0 = kv_head * head_dim + c
            for t in range(0, block_size - 1, 2):
                v = load(flat_values, v0 + t * stride)
                w = load(flat_values, v0 + (t + 1) * stride)
                a0 = muladd(splat(probs[i0, t]), v, a0)
                a1 = muladd(splat(probs[i1, t]), v, a1)
                a2 = muladd(splat(probs[i2, t]), v, a2)
                a3 = muladd(splat(probs[i3, t]), v, a3)
                b0 = muladd(splat(probs[i0, t + 1]), w, b0)
                b1 = muladd(splat(probs[i1, t + 1]), w, b1)
                b2 = muladd(splat(probs[i2, t + 1]), w, b2)
                b3 = muladd(splat(probs[i3, t + 1]), w, b3)
            if block_size % 2:
                t = block_size - 1
                v = load(flat_values, v0 + t * stride)
                a0 = muladd(splat(probs[i0, t]), v, a0)
                a1 = muladd(splat(probs[i1, t]), v, a1)
                a2 = muladd(splat(probs[i2, t]), v, a2)
                a3 = muladd(splat(probs[i3, t]), v, a3)
            # (a repeated vector stores the same sums twice)
            store(acc[i3], c, add(a3, b3))
            store(acc[i2], c, add(a2, b2))
            store(acc[i1], c, add(a1, b1))
            store(acc[i0], c, add(a0, b0))
        for j in range(i, i3 + 1):
            total = np.float32(0.0)
            for t in range(block_size):
                total += probs[j, t]
            row_sum[j] += total
        i = i3 + 1

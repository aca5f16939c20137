"""A block's scores and weighted values in 16-lane register tiles (kvcore.kernels.cpu.simd),
for head_dim a multiple of 16 (and, for the scores, blocks of a multiple of 8 keys): the
general loops in kvcore.kernels.cpu.attention_blocks serve every other shape.

Vectors are a tile's query rows x heads, flat: vector i is query head i % num_heads of row
i // num_heads, and reads KV head (i % num_heads) // group.

Reduction order (fixed per query vector, whatever the tile holds): a score is 16 lanes, lane l
summing q[c + l] k[c + l] by fused multiply-adds over the chunks c = 0, 16, ... in order, then
the lanes summed by sums16's tree; a weighted value element is acc + p[0] v[0] + p[1] v[1] +
... over the block's keys in order, one fused multiply-add each. Which vectors share a pass
(pairs, fours, a lone vector repeated) only decides which loads are shared.

Arrays are flat and indexed through the simd module's intrinsics (no views, no negative-index
wraparound in the inner loops): a view made in a loop costs two atomic reference counts, and
the wraparound arithmetic as much as the multiply-adds it feeds."""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.cpu.attention_blocks import FASTMATH
from kvcore.kernels.cpu.simd import LANES, fma, load, splat, splat_at, store, store_split, sums16


@njit(inline="always")
def _next_vector(i: int, g: int, group: int, num_heads: int) -> tuple[int, int]:
    """The vector after i of the same KV head (i is its group member g): the next member, or
    the first member in the next row."""
    if g + 1 < group:
        return i + 1, g + 1
    return i + num_heads - group + 1, 0


@njit(fastmath=FASTMATH, cache=True)
def tile_scores(queries: np.ndarray, keys: np.ndarray, num_heads: int, group: int,
                scores: np.ndarray) -> None:
    """scores (V, bs) = queries (V, D) . keys (bs, Hkv, D), two vectors of one KV head (of one
    row or of two) against 8 keys at a time: 16 independent accumulators over head_dim (each
    key chunk loaded once serves both vectors), then one shuffle tree gives the 16 scores as
    one vector, its halves the two vectors' rows (16 horizontal reductions would cost three
    times as much). A lone last vector pairs with itself."""
    num_vecs, head_dim = queries.shape
    block_size, num_kv_heads = keys.shape[0], keys.shape[1]
    kf = keys.reshape(keys.size)
    qf = queries.reshape(queries.size)
    sf = scores.reshape(scores.size)
    stride = num_kv_heads * head_dim  # from one key to the next
    num_pairs = (num_vecs // num_heads * group + 1) // 2  # per KV head
    zero = splat(np.float32(0.0))
    for h in range(num_kv_heads):
        i, g = h * group, 0
        for _ in range(num_pairs):
            j, g = _next_vector(i, g, group, num_heads)
            j = j if j < num_vecs else i
            qi, qj = i * head_dim, j * head_dim
            for t in range(0, block_size, LANES // 2):
                k = (t * num_kv_heads + h) * head_dim
                a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
                b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = zero
                for c in range(0, head_dim, LANES):
                    x = load(qf, qi + c)
                    y = load(qf, qj + c)
                    key = load(kf, k + c)
                    a0, b0 = fma(x, key, a0), fma(y, key, b0)
                    key = load(kf, k + c + stride)
                    a1, b1 = fma(x, key, a1), fma(y, key, b1)
                    key = load(kf, k + c + 2 * stride)
                    a2, b2 = fma(x, key, a2), fma(y, key, b2)
                    key = load(kf, k + c + 3 * stride)
                    a3, b3 = fma(x, key, a3), fma(y, key, b3)
                    key = load(kf, k + c + 4 * stride)
                    a4, b4 = fma(x, key, a4), fma(y, key, b4)
                    key = load(kf, k + c + 5 * stride)
                    a5, b5 = fma(x, key, a5), fma(y, key, b5)
                    key = load(kf, k + c + 6 * stride)
                    a6, b6 = fma(x, key, a6), fma(y, key, b6)
                    key = load(kf, k + c + 7 * stride)
                    a7, b7 = fma(x, key, a7), fma(y, key, b7)
                # lanes 0-7: vector i against keys t..t+7; lanes 8-15: vector j
                store_split(sf, i * block_size + t, j * block_size + t,
                            sums16((a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6,
                                    b7)))
            i, g = _next_vector(j, g, group, num_heads)


@njit(fastmath=FASTMATH, cache=True)
def tile_values(probs: np.ndarray, values: np.ndarray, num_heads: int, group: int,
                acc: np.ndarray, row_sum: np.ndarray) -> None:
    """acc (V, D) += probs (V, bs) @ values (bs, Hkv, D), and row_sum (V,) += probs' rows.
    Four vectors of one KV head (of one row or of several) per pass (the last pass repeats
    its last vector where fewer are left), four chunks of 16 channels at a time (one where
    fewer are left): each value chunk is loaded once for the four vectors, and the 16
    accumulators stay in registers over the block's keys (16 independent chains keep the FMA
    pipes busy)."""
    num_vecs, block_size = probs.shape
    num_kv_heads, head_dim = values.shape[1], values.shape[2]
    vf = values.reshape(values.size)
    pf = probs.reshape(probs.size)
    af = acc.reshape(acc.size)
    stride = num_kv_heads * head_dim  # from one key to the next
    wide = head_dim - head_dim % (4 * LANES)  # channels taken four chunks at a time
    per_head = num_vecs // num_heads * group
    for h in range(num_kv_heads):
        i0, g = h * group, 0
        for _ in range(0, per_head, 4):
            i1, g = _next_vector(i0, g, group, num_heads)
            i2, g = _next_vector(i1, g, group, num_heads)
            i3, g = _next_vector(i2, g, group, num_heads)
            after, g = _next_vector(i3, g, group, num_heads)
            i1 = i1 if i1 < num_vecs else i0
            i2 = i2 if i2 < num_vecs else i1
            i3 = i3 if i3 < num_vecs else i2
            p0, p1, p2, p3 = i0 * block_size, i1 * block_size, i2 * block_size, \
                i3 * block_size
            x0, x1, x2, x3 = i0 * head_dim, i1 * head_dim, i2 * head_dim, i3 * head_dim
            for c in range(0, wide, 4 * LANES):
                a0, b0, c0, d0 = load(af, x0 + c), load(af, x0 + c + 16), \
                    load(af, x0 + c + 32), load(af, x0 + c + 48)
                a1, b1, c1, d1 = load(af, x1 + c), load(af, x1 + c + 16), \
                    load(af, x1 + c + 32), load(af, x1 + c + 48)
                a2, b2, c2, d2 = load(af, x2 + c), load(af, x2 + c + 16), \
                    load(af, x2 + c + 32), load(af, x2 + c + 48)
                a3, b3, c3, d3 = load(af, x3 + c), load(af, x3 + c + 16), \
                    load(af, x3 + c + 32), load(af, x3 + c + 48)
                v0 = h * head_dim + c
                for t in range(block_size):
                    at = v0 + t * stride
                    va, vb, vc, vd = load(vf, at), load(vf, at + 16), load(vf, at + 32), \
                        load(vf, at + 48)
                    w = splat_at(pf, p0 + t)
                    a0, b0, c0, d0 = fma(w, va, a0), fma(w, vb, b0), fma(w, vc, c0), \
                        fma(w, vd, d0)
                    w = splat_at(pf, p1 + t)
                    a1, b1, c1, d1 = fma(w, va, a1), fma(w, vb, b1), fma(w, vc, c1), \
                        fma(w, vd, d1)
                    w = splat_at(pf, p2 + t)
                    a2, b2, c2, d2 = fma(w, va, a2), fma(w, vb, b2), fma(w, vc, c2), \
                        fma(w, vd, d2)
                    w = splat_at(pf, p3 + t)
                    a3, b3, c3, d3 = fma(w, va, a3), fma(w, vb, b3), fma(w, vc, c3), \
                        fma(w, vd, d3)
                # (a repeated vector stores the same sums twice)
                store(af, x3 + c, a3)
                store(af, x3 + c + 16, b3)
                store(af, x3 + c + 32, c3)
                store(af, x3 + c + 48, d3)
                store(af, x2 + c, a2)
                store(af, x2 + c + 16, b2)
                store(af, x2 + c + 32, c2)
                store(af, x2 + c + 48, d2)
                store(af, x1 + c, a1)
                store(af, x1 + c + 16, b1)
                store(af, x1 + c + 32, c1)
                store(af, x1 + c + 48, d1)
                store(af, x0 + c, a0)
                store(af, x0 + c + 16, b0)
                store(af, x0 + c + 32, c0)
                store(af, x0 + c + 48, d0)
            for c in range(wide, head_dim, LANES):
                a0, a1, a2, a3 = load(af, x0 + c), load(af, x1 + c), load(af, x2 + c), \
                    load(af, x3 + c)
                v0 = h * head_dim + c
                for t in range(block_size):
                    v = load(vf, v0 + t * stride)
                    a0 = fma(splat_at(pf, p0 + t), v, a0)
                    a1 = fma(splat_at(pf, p1 + t), v, a1)
                    a2 = fma(splat_at(pf, p2 + t), v, a2)
                    a3 = fma(splat_at(pf, p3 + t), v, a3)
                store(af, x3 + c, a3)
                store(af, x2 + c, a2)
                store(af, x1 + c, a1)
                store(af, x0 + c, a0)
            i0 = after
    for i in range(num_vecs):
        total = np.float32(0.0)
        for t in range(block_size):
            total += pf[i * block_size + t]
        row_sum[i] += total

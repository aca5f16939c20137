"""A sealed int4 block's scores and weighted values straight from its row, in 16-lane register
tiles: no float32 copy of the block is written or read back.

Keys are per-channel affine over the block (k_c = z_c + s_c n_c), so a score is
q . k = sum_c q_c z_c + sum_c (q_c s_c) n_c: per block and query vector, q' = q * s and the
constant q . z once (`key_queries`), then per key a dot of q' with the key's codes. Values are
per token and group (v_c = z_g + s_g n_c), so a value chunk is rebuilt in registers from its
codes by one fused multiply-add with the group's scale and zero, shared by the four query
vectors it serves (`sealed_values`).

Channels are in "split" order (kvcore.kernels.cpu.kv_int4_simd): per chunk of 32, the 16 even ones
then the 16 odd ones, as the low and high nibbles of the chunk's 16 code bytes. Queries are split
once per work item, value accumulators are kept split and joined once at its end. For head_dim a
multiple of 32, blocks a multiple of 8 keys and value groups a multiple of 32 channels (a chunk's
scale is one number); other shapes unpack blocks (kvcore.kernels.cpu.kv_int4_blocks). Which path
reads a sealed block depends on these shapes only, never on how many query rows an item holds: the
two paths round differently, and a row must read a block the same way in any tile. """

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.cpu.attention_blocks import FASTMATH
from kvcore.kernels.cpu.kv_int4_simd import (
    CHUNK,
    even_halves,
    halves,
    high_codes,
    low_codes,
    mul,
    odd_halves,
    total,
)
from kvcore.kernels.cpu.simd import (
    LANES,
    load,
    muladd,
    splat,
    store,
    store_halves,
    sums16,
)


@njit(cache=True)
def fits(block_size: int, head_dim: int, value_group: int) -> bool:
    """Whether a sealed block of this shape takes the tiles (else it is unpacked)."""
    return head_dim % CHUNK == 0 and block_size % (LANES // 2) == 0 and value_group % CHUNK == 0


@njit(fastmath=FASTMATH, cache=True)
def split_channels(x: np.ndarray, out: np.ndarray) -> None:
    """out (V, D) = x (V, D) with each chunk of 32 channels as its even ones, then its odd."""
    for i in range(x.shape[0]):
        for c in range(0, x.shape[1], CHUNK):
            for j in range(LANES):
                out[i, c + j] = x[i, c + 2 * j]
                out[i, c + LANES + j] = x[i, c + 2 * j + 1]


@njit(fastmath=FASTMATH, cache=True)
def add_joined(split: np.ndarray, out: np.ndarray) -> None:
    """out (V, D) += split (V, D) put back in channel order."""
    for i in range(out.shape[0]):
        for c in range(0, out.shape[1], CHUNK):
            for j in range(LANES):
                out[i, c + 2 * j] += split[i, c + j]
                out[i, c + 2 * j + 1] += split[i, c + LANES + j]


@njit(cache=True)
def item_scratch(queries: np.ndarray, num_kv_heads: int, block_size: int, value_group: int,
                 used: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                      np.ndarray, np.ndarray]:
    """A work item's arrays for the tiles (queries (V, D) its query vectors), empty when they
    are not used: (the queries in split order, q * key scales (V, D), q . key zeros (V,), a K
    row's scales and zeros (2, Hkv, D) split, the sealed blocks' weighted values (V, D) split,
    a V row's scales and zeros (2 * bs * Hkv * D / value_group,))."""
    num_vecs, head_dim = queries.shape if used else (0, queries.shape[1])
    split_queries = np.empty((num_vecs, head_dim), np.float32)  # (V, D)
    if used:
        split_channels(queries, split_queries)
    scaled = np.empty((num_vecs, head_dim), np.float32)  # (V, D)
    offsets = np.empty(num_vecs, np.float32)  # (V,)
    key_params = np.empty((2, num_kv_heads if used else 0, head_dim), np.float32)
    split_acc = np.zeros((num_vecs, head_dim), np.float32)  # (V, D)
    num_value_params = 2 * block_size * num_kv_heads * (head_dim // value_group) if used else 0
    return (split_queries, scaled, offsets, key_params, split_acc,
            np.empty(num_value_params, np.float32))


@njit(fastmath=FASTMATH, cache=True)
def key_queries(queries: np.ndarray, row: np.ndarray, num_heads: int, group: int,
                block_size: int, params: np.ndarray, scaled: np.ndarray,
                offsets: np.ndarray) -> None:
    """For each query vector i (split order, V x D) of KV head h: scaled[i] = queries[i] * the
    block's key scales of h, offsets[i] = queries[i] . its key zeros (row: the sealed K row;
    params: (2, Hkv, D) scratch for its scales and zeros in split order)."""
    num_vecs, head_dim = queries.shape
    num_kv_heads = params.shape[1]
    flat_params = params.reshape(params.size)
    scales_at = block_size * num_kv_heads * head_dim // 2  # after the codes: scales, zeros
    for c in range(0, flat_params.shape[0], CHUNK):
        store(flat_params, c, even_halves(row, scales_at + 2 * c))
        store(flat_params, c + LANES, odd_halves(row, scales_at + 2 * c))
    zeros = num_kv_heads * head_dim
    flat_q = queries.reshape(queries.size)
    flat_scaled = scaled.reshape(scaled.size)
    for i in range(num_vecs):
        h = (i % num_heads) // group
        part = splat(np.float32(0.0))
        for c in range(0, head_dim, CHUNK):
            q_even = load(flat_q, i * head_dim + c)
            q_odd = load(flat_q, i * head_dim + c + LANES)
            at = h * head_dim + c
            store(flat_scaled, i * head_dim + c, mul(q_even, load(flat_params, at)))
            store(flat_scaled, i * head_dim + c + LANES,
                  mul(q_odd, load(flat_params, at + LANES)))
            part = muladd(q_even, load(flat_params, zeros + at), part)
            part = muladd(q_odd, load(flat_params, zeros + at + LANES), part)
        offsets[i] = total(part)


@njit(fastmath=FASTMATH, cache=True)
def sealed_scores(scaled: np.ndarray, offsets: np.ndarray, row: np.ndarray, num_heads: int,
                  group: int, num_kv_heads: int, scores: np.ndarray) -> None:
    """scores (V, bs) = offsets[i] + scaled[i] . codes of each key of the block (row: the
    sealed K row; scaled, offsets from key_queries). As tile_scores: two vectors of one KV head
    against 8 keys at a time, 16 accumulators, the codes of a chunk converted once for both."""
    num_vecs, head_dim = scaled.shape
    block_size = scores.shape[1]
    flat = scaled.reshape(scaled.size)
    stride = num_kv_heads * head_dim // 2  # code bytes from one key to the next
    zero = splat(np.float32(0.0))
    i = 0
    while i < num_vecs:
        h = (i % num_heads) // group
        j = i + 1 if i + 1 < num_vecs and (i + 1) % num_heads // group == h else i
        for t in range(0, block_size, LANES // 2):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = zero
            b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = zero
            for c in range(0, head_dim, CHUNK):
                x_even, x_odd = load(flat, i * head_dim + c), load(flat, i * head_dim + c + LANES)
                y_even, y_odd = load(flat, j * head_dim + c), load(flat, j * head_dim + c + LANES)
                k = (t * num_kv_heads + h) * (head_dim // 2) + c // 2
                lo, hi = low_codes(row, k), high_codes(row, k)
                a0 = muladd(x_odd, hi, muladd(x_even, lo, a0))
                b0 = muladd(y_odd, hi, muladd(y_even, lo, b0))
                lo, hi = low_codes(row, k + stride), high_codes(row, k + stride)
                a1 = muladd(x_odd, hi, muladd(x_even, lo, a1))
                b1 = muladd(y_odd, hi, muladd(y_even, lo, b1))
                lo, hi = low_codes(row, k + 2 * stride), high_codes(row, k + 2 * stride)
                a2 = muladd(x_odd, hi, muladd(x_even, lo, a2))
                b2 = muladd(y_odd, hi, muladd(y_even, lo, b2))
                lo, hi = low_codes(row, k + 3 * stride), high_codes(row, k + 3 * stride)
                a3 = muladd(x_odd, hi, muladd(x_even, lo, a3))
                b3 = muladd(y_odd, hi, muladd(y_even, lo, b3))
                lo, hi = low_codes(row, k + 4 * stride), high_codes(row, k + 4 * stride)
                a4 = muladd(x_odd, hi, muladd(x_even, lo, a4))
                b4 = muladd(y_odd, hi, muladd(y_even, lo, b4))
                lo, hi = low_codes(row, k + 5 * stride), high_codes(row, k + 5 * stride)
                a5 = muladd(x_odd, hi, muladd(x_even, lo, a5))
                b5 = muladd(y_odd, hi, muladd(y_even, lo, b5))
                lo, hi = low_codes(row, k + 6 * stride), high_codes(row, k + 6 * stride)
                a6 = muladd(x_odd, hi, muladd(x_even, lo, a6))
                b6 = muladd(y_odd, hi, muladd(y_even, lo, b6))
                lo, hi = low_codes(row, k + 7 * stride), high_codes(row, k + 7 * stride)
                a7 = muladd(x_odd, hi, muladd(x_even, lo, a7))
                b7 = muladd(y_odd, hi, muladd(y_even, lo, b7))
            store_halves(scores[i], scores[j], t, sums16((a0, a1, a2, a3, a4, a5, a6, a7, b0,
                                                          b1, b2, b3, b4, b5, b6, b7)))
        for t in range(block_size):
            scores[i, t] += offsets[i]
        if j != i:
            for t in range(block_size):
                scores[j, t] += offsets[j]
        i = j + 1


@njit(fastmath=FASTMATH, cache=True)
def value_params(row: np.ndarray, at: int, num_params: int, out: np.ndarray) -> None:
    """out (2 * num_params,) = a sealed V row's scales, then zeros (from byte `at`, after the
    codes), as float32 (num_params = bs * Hkv * D / group: a multiple of 8 for shapes that
    fit)."""
    for p in range(0, 2 * num_params, LANES):
        store(out, p, halves(row, at + 2 * p))


@njit(fastmath=FASTMATH, cache=True)
def sealed_values(probs: np.ndarray, row: np.ndarray, params: np.ndarray, num_heads: int,
                  group: int, num_kv_heads: int, value_group: int, acc: np.ndarray,
                  row_sum: np.ndarray) -> None:
    """acc (V, D, split order) += probs (V, bs) @ the block's values, row_sum (V,) += probs'
    rows (row: the sealed V row; params: its value_params). As tile_values: up to four
    vectors of one KV head per pass over a chunk of 32 channels, eight accumulators in
    registers over the block's keys; each key's chunk is rebuilt once (zero + scale * code)
    for the four."""
    num_vecs, head_dim = acc.shape
    block_size = probs.shape[1]
    num_groups = head_dim // value_group
    num_params = block_size * num_kv_heads * num_groups
    flat = acc.reshape(acc.size)
    stride = num_kv_heads * head_dim // 2  # code bytes from one key to the next
    i = 0
    while i < num_vecs:
        h = (i % num_heads) // group
        last = (i // num_heads) * num_heads + (h + 1) * group - 1  # of this KV head
        i0, i1, i2, i3 = i, min(i + 1, last), min(i + 2, last), min(i + 3, last)
        for c in range(0, head_dim, CHUNK):
            e0, o0 = load(flat, i0 * head_dim + c), load(flat, i0 * head_dim + c + LANES)
            e1, o1 = load(flat, i1 * head_dim + c), load(flat, i1 * head_dim + c + LANES)
            e2, o2 = load(flat, i2 * head_dim + c), load(flat, i2 * head_dim + c + LANES)
            e3, o3 = load(flat, i3 * head_dim + c), load(flat, i3 * head_dim + c + LANES)
            p = h * num_groups + c // value_group  # the chunk's group, of key 0
            k = h * (head_dim // 2) + c // 2  # its code bytes, of key 0
            for t in range(block_size):
                scale = splat(params[p])
                zero = splat(params[num_params + p])
                even = muladd(scale, low_codes(row, k), zero)
                odd = muladd(scale, high_codes(row, k), zero)
                w = splat(probs[i0, t])
                e0, o0 = muladd(w, even, e0), muladd(w, odd, o0)
                w = splat(probs[i1, t])
                e1, o1 = muladd(w, even, e1), muladd(w, odd, o1)
                w = splat(probs[i2, t])
                e2, o2 = muladd(w, even, e2), muladd(w, odd, o2)
                w = splat(probs[i3, t])
                e3, o3 = muladd(w, even, e3), muladd(w, odd, o3)
                p += num_kv_heads * num_groups
                k += stride
            # (a repeated vector stores the same sums twice)
            store(flat, i3 * head_dim + c, e3)
            store(flat, i3 * head_dim + c + LANES, o3)
            store(flat, i2 * head_dim + c, e2)
            store(flat, i2 * head_dim + c + LANES, o2)
            store(flat, i1 * head_dim + c, e1)
            store(flat, i1 * head_dim + c + LANES, o1)
            store(flat, i0 * head_dim + c, e0)
            store(flat, i0 * head_dim + c + LANES, o0)
        for v in range(i, i3 + 1):
            part = np.float32(0.0)
            for t in range(block_size):
                part += probs[v, t]
            row_sum[v] += part
        i = i3 + 1

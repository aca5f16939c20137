"""Compiled CPU paged attention (numba): reads K/V blocks in place, online softmax per work item.

The batch is cut into work items: (sequence, a tile of up to ROWS_PER_TILE query rows, a range
of keys), every head. An item walks the block table over its keys, reads each block (all its
KV heads: one contiguous read) where it lies (fp32) or converted to float32 in one pass into a
small L1-resident buffer (bf16 shifted, fp16 widened as halves, fp8 rebuilt from its bits) while
the next block is prefetched, and keeps a running maximum, sum and weighted values for every
query vector of the tile (rows x heads), so one read of a block serves all of them. Items of
one (sequence, tile) that split a long key range (so that a batch of one at a long context
still gives every thread work) are merged afterwards from their partial maxima, sums and
outputs.

Only this module imports numba; kvcore.kernels.cpu.jit decides whether it runs at all.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from kvcore.kernels.cpu import kv_int4_tiles
from kvcore.kernels.cpu.attention_blocks import (
    FASTMATH,
    MODE_FP32,
    MODE_INT4,
    block_scores,
    block_values,
    exp_rows,
    load_block,
    prefetch_block,
)
from kvcore.kernels.cpu.attention_tiles import tile_scores, tile_values
from kvcore.kernels.cpu.kv_int4_blocks import load_int4_block
from kvcore.kernels.cpu.simd import LANES

# an int4 cache's fp16 window (K, V: (num_slots, bs, Hkv, D) as uint16 bits), its block ->
# window slot table (num_blocks,), the V rows' group and its blocks per super-block (a row reads
# its own super-block from the window, every earlier block sealed); placeholders (0 blocks per
# super-block) for the other dtypes
Int4Args = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]
ROWS_PER_TILE = 16  # query rows of a prefill chunk per item: 16 x group vectors share each block
SPLIT_KEYS = 256  # key ranges are cut at the multiples of this (rounded up to whole blocks)


ERRORS = ("", "a sequence has more query tokens than its context_lens (or fewer than 0)",
          "context_lens exceed the blocks that block_tables can hold",
          "block_tables holds a block id outside the cache")


@njit(cache=True)
def check_batch(block_tables: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray,
                block_size: int, num_blocks: int, window: int) -> int:
    """0, or the index in ERRORS of what is wrong with the batch arrays: the kernel reads
    without bounds checks, so every block id it will read is checked here first."""
    for s in range(context_lens.shape[0]):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        ctx = context_lens[s]
        if q_len < 0 or q_len > ctx:
            return 1
        last = (ctx - 1) // block_size
        if last >= block_tables.shape[1]:
            return 2
        first_key = max(0, ctx - q_len - window + 1) if window > 0 else 0
        for b in range(first_key // block_size, last + 1):
            if block_tables[s, b] >= num_blocks:
                return 3
    return 0


@njit(cache=True, inline="always")
def _tile_end(first_pos: int, r0: int, q_len: int, span: int) -> int:
    """The end row of the tile starting at row r0: ROWS_PER_TILE rows, cut at the next
    super-block boundary (span tokens; 0: none), so a tile's rows read every block alike."""
    r1 = min(q_len, r0 + ROWS_PER_TILE)
    if span > 0:
        r1 = min(r1, ((first_pos + r0) // span + 1) * span - first_pos)
    return r1


@njit(cache=True)
def work_items(context_lens: np.ndarray, query_start_loc: np.ndarray, block_size: int,
               window: int, span: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(items (W, 6) int64: seq, row0, row1, key0, key1, offset of its partial rows;
    groups (N, 4) int64: first query row in T, rows, first item, end item; partial rows).
    Rows are relative to the sequence's chunk; an item covers every head; an int4 cache's
    tiles end at super-block boundaries (span: its tokens per super-block; 0 for the other
    dtypes). Key ranges are cut at fixed positions (SPLIT_KEYS), never by the batch's size: a
    row's pieces are its own."""
    num_seqs = context_lens.shape[0]
    total_keys = 0
    num_groups = 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        first_pos = context_lens[s] - q_len
        r0 = 0
        while r0 < q_len:
            r1 = _tile_end(first_pos, r0, q_len, span)
            lo = max(0, first_pos + r0 - window + 1) if window > 0 else 0
            total_keys += first_pos + r1 - lo
            num_groups += 1
            r0 = r1
    split = -(-SPLIT_KEYS // block_size) * block_size  # whole blocks per piece
    groups = np.empty((num_groups, 4), np.int64)  # (N, 4)
    items = np.empty((num_groups + total_keys // split + num_groups, 6), np.int64)  # (W, 6)
    g = 0
    w = 0
    offset = 0
    for s in range(num_seqs):
        q_len = query_start_loc[s + 1] - query_start_loc[s]
        first_pos = context_lens[s] - q_len
        r0 = 0
        while r0 < q_len:
            r1 = _tile_end(first_pos, r0, q_len, span)
            lo = max(0, first_pos + r0 - window + 1) if window > 0 else 0
            hi = first_pos + r1
            groups[g, 0] = query_start_loc[s] + r0
            groups[g, 1] = r1 - r0
            groups[g, 2] = w
            k0 = lo
            while k0 < hi:  # pieces end on multiples of split
                k1 = min(hi, (k0 // split + 1) * split)
                items[w, 0] = s
                items[w, 1] = r0
                items[w, 2] = r1
                items[w, 3] = k0
                items[w, 4] = k1
                items[w, 5] = offset
                offset += r1 - r0
                w += 1
                k0 = k1
            groups[g, 3] = w
            g += 1
            r0 = r1
    return items[:w], groups, offset


@njit(fastmath=FASTMATH, cache=True)
def _attend_item(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 k_bits: np.ndarray, v_bits: np.ndarray, mode: int, int4: Int4Args,
                 block_tables: np.ndarray, context_lens: np.ndarray,
                 query_start_loc: np.ndarray, window: int, item: np.ndarray,
                 part_max: np.ndarray, part_sum: np.ndarray, part_out: np.ndarray) -> None:
    """One item: its query vectors (rows x heads) over keys [key0, key1), unnormalized, into
    the partial arrays at the item's offset. An fp32 cache's blocks are read where they lie
    (k_cache, v_cache); a 16-bit or fp8 cache's (k_bits, v_bits: its raw bits) are converted
    into a float32 block first; an int4 cache's (k_bits, v_bits: its sealed rows) are
    unpacked from their rows or widened from their fp16 window slot (int4). Keys outside the
    item's range are masked like the future."""
    s, r0, r1, k0, k1, offset = item[0], item[1], item[2], item[3], item[4], item[5]
    k_window, v_window, window_slot, value_group, window_blocks = int4
    shape = (k_cache.shape if mode == MODE_FP32 else k_window.shape if mode == MODE_INT4
             else k_bits.shape)  # int4: rows as (num_blocks, 1, 1, row_bytes)
    block_size, num_kv_heads, head_dim = shape[1], shape[2], shape[3]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    q_len = query_start_loc[s + 1] - query_start_loc[s]
    first_pos = context_lens[s] - q_len
    num_vecs = (r1 - r0) * num_heads
    # (V, D) the tile's query rows x heads, dense
    queries = query[query_start_loc[s] + r0:query_start_loc[s] + r1].reshape(num_vecs, head_dim)
    row_max = np.full(num_vecs, -np.inf, np.float32)  # (V,) running maxima
    row_sum = np.zeros(num_vecs, np.float32)  # (V,) running sums of exp(score - max)
    acc = np.zeros((num_vecs, head_dim), np.float32)  # (V, D) weighted values
    key_block = np.empty((block_size, num_kv_heads, head_dim), np.float32)  # (bs, Hkv, D)
    value_block = np.empty((block_size, num_kv_heads, head_dim), np.float32)
    probs = np.empty((num_vecs, block_size), np.float32)  # (V, bs) this block's scores, weights
    int4_params = np.empty(2 * num_kv_heads * head_dim, np.float32)  # int4 K: scales, zeros
    # register tiles where the shapes allow (head_dim in 16s; for scores, the block in 8s)
    simd_values = head_dim % LANES == 0
    simd_scores = simd_values and block_size % (LANES // 2) == 0
    # sealed int4 blocks read in place by kvcore.kernels.cpu.kv_int4_tiles where the shapes allow:
    # queries and their weighted values in its split channel order
    tiles = mode == MODE_INT4 and kv_int4_tiles.fits(block_size, head_dim, value_group)
    split_queries, scaled, offsets, key_params, split_acc, value_params = \
        kv_int4_tiles.item_scratch(queries, num_kv_heads, block_size, value_group, tiles)
    last_pos = first_pos + r1 - 1
    last_block = (k1 - 1) // block_size
    # int4: the tile's own super-block (its rows all share it) is read from the window, every
    # earlier block sealed
    own_first = ((first_pos + r0) // block_size // window_blocks * window_blocks
                 if mode == MODE_INT4 else 0)
    for b in range(k0 // block_size, last_block + 1):
        block_id = block_tables[s, b]
        if block_id < 0:  # released (outside every row's window) or padding
            continue
        if b < last_block and block_tables[s, b + 1] >= 0:
            if mode == MODE_FP32:
                prefetch_block(k_cache, block_tables[s, b + 1])
                prefetch_block(v_cache, block_tables[s, b + 1])
            else:
                prefetch_block(k_bits, block_tables[s, b + 1])
                prefetch_block(v_bits, block_tables[s, b + 1])
        first_key = b * block_size
        t0 = max(k0, first_key) - first_key  # the item's keys in this block: [t0, t1)
        t1 = min(k1, first_key + block_size) - first_key
        sealed_tile = tiles and b < own_first
        if sealed_tile:
            k_row = k_bits[block_id].reshape(k_bits.shape[3])
            kv_int4_tiles.key_queries(split_queries, k_row, num_heads, group, block_size,
                                      key_params, scaled, offsets)
            kv_int4_tiles.sealed_scores(scaled, offsets, k_row, num_heads, group, num_kv_heads,
                                        probs)
        else:
            if mode == MODE_FP32:
                keys = k_cache[block_id]
            elif mode == MODE_INT4:
                load_int4_block(k_bits, k_window, window_slot, block_id, 0, int4_params,
                                b >= own_first, key_block)
                keys = key_block
            else:
                load_block(k_bits, block_id, mode, key_block)
                keys = key_block
            if simd_scores:
                tile_scores(queries, keys, num_heads, group, probs)
            else:
                block_scores(queries, keys, num_heads, group, probs)
        # outside the item's keys, the future of the tile's first row, or keys behind its
        # last row's window
        if t0 > 0 or t1 < block_size or first_key + t1 - 1 > first_pos + r0 or (
                window > 0 and first_key + t0 <= last_pos - window):
            for i in range(num_vecs):
                pos = first_pos + r0 + i // num_heads
                for t in range(block_size):
                    key_pos = first_key + t
                    if t < t0 or t >= t1 or key_pos > pos or (
                            window > 0 and key_pos <= pos - window):
                        probs[i, t] = -np.inf
        for i in range(num_vecs):
            top = row_max[i]
            for t in range(block_size):
                top = max(top, probs[i, t])
            if top > row_max[i]:  # rescale what the row has gathered so far
                alpha = np.float32(math.exp(row_max[i] - top))
                row_sum[i] *= alpha
                for d in range(head_dim):
                    acc[i, d] *= alpha
                if tiles:
                    for d in range(head_dim):
                        split_acc[i, d] *= alpha
                row_max[i] = top
        exp_rows(probs, row_max)
        if sealed_tile:  # (a sealed block's scales and zeros are finite: masked keys add 0)
            v_row = v_bits[block_id].reshape(v_bits.shape[3])
            kv_int4_tiles.value_params(v_row, block_size * num_kv_heads * head_dim // 2,
                                       value_params.shape[0] // 2, value_params)
            kv_int4_tiles.sealed_values(probs, v_row, value_params, num_heads, group,
                                        num_kv_heads, value_group, split_acc, row_sum)
            continue
        if mode == MODE_FP32:
            values = v_cache[block_id]
        elif mode == MODE_INT4:
            load_int4_block(v_bits, v_window, window_slot, block_id, value_group, int4_params,
                            b >= own_first, value_block)
            values = value_block
        else:
            load_block(v_bits, block_id, mode, value_block)
            values = value_block
        if t0 > 0 or t1 < block_size:  # slots outside the range may hold stale inf / nan
            if mode == MODE_FP32:  # never written: copy the block before zeroing them
                value_block[:] = values
                values = value_block
            for t in range(block_size):
                if t < t0 or t >= t1:
                    values[t] = 0.0
        if simd_values:
            tile_values(probs, values, num_heads, group, acc, row_sum)
        else:
            block_values(probs, values, num_heads, group, acc, row_sum)
    if tiles:
        kv_int4_tiles.add_joined(split_acc, acc)
    start = offset * num_heads
    part_max[start:start + num_vecs] = row_max
    part_sum[start:start + num_vecs] = row_sum
    part_out[start:start + num_vecs] = acc


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def attend(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_bits: np.ndarray,
           v_bits: np.ndarray, mode: int, int4: Int4Args, block_tables: np.ndarray,
           context_lens: np.ndarray, query_start_loc: np.ndarray, window: int,
           items: np.ndarray, groups: np.ndarray, num_partial_rows: int, v_scale: float,
           out: np.ndarray) -> None:
    """Every item in parallel, then every group's items merged into out (T, H, D)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    part_max = np.empty(num_partial_rows * num_heads, np.float32)  # (P,)
    part_sum = np.empty(num_partial_rows * num_heads, np.float32)
    part_out = np.empty((num_partial_rows * num_heads, head_dim), np.float32)  # (P, D)
    for w in prange(items.shape[0]):
        _attend_item(query, k_cache, v_cache, k_bits, v_bits, mode, int4, block_tables,
                     context_lens, query_start_loc, window, items[w], part_max, part_sum,
                     part_out)
    for g in prange(groups.shape[0]):
        merge_group(groups[g], items, part_max, part_sum, part_out, v_scale, out)


@njit(fastmath=FASTMATH, cache=True)
def merge_group(group: np.ndarray, items: np.ndarray, part_max: np.ndarray,
                part_sum: np.ndarray, part_out: np.ndarray, v_scale: float,
                out: np.ndarray) -> None:
    """One group's items (a tile of one sequence's rows, its key pieces) merged in item order
    into out (T, H, D): the pieces' maxima, then their sums and values rescaled and added."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    row0, num_rows, i0, i1 = group[0], group[1], group[2], group[3]
    merged = np.empty(head_dim, np.float32)  # (D,)
    for i in range(num_rows * num_heads):
        top = -np.inf
        for w in range(i0, i1):
            top = max(top, part_max[items[w, 5] * num_heads + i])
        total = np.float32(0.0)
        merged[:] = 0.0
        for w in range(i0, i1):
            j = items[w, 5] * num_heads + i
            if part_sum[j] == 0.0:  # an item whose keys this row cannot see
                continue
            weight = np.float32(math.exp(part_max[j] - top))
            total += weight * part_sum[j]
            for d in range(head_dim):
                merged[d] += weight * part_out[j, d]
        norm = np.float32(v_scale) / total
        for d in range(head_dim):
            out[row0 + i // num_heads, i % num_heads, d] = merged[d] * norm


def set_threads(threads: int) -> None:
    """numba's threads for this calling thread's parallel regions (at most its pool's size)."""
    limit: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    numba.set_num_threads(max(1, min(threads, limit)))


def run(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, k_bits: np.ndarray,
        v_bits: np.ndarray, mode: int, int4: Int4Args, block_tables: np.ndarray,
        context_lens: np.ndarray, query_start_loc: np.ndarray, window: int, items: np.ndarray,
        groups: np.ndarray, num_partial_rows: int, v_scale: float, out: np.ndarray) -> None:
    """attend(...), its items handed out one at a time: a thread that starts late (a busy
    machine) takes fewer items instead of holding up the region with an equal share. Scoped
    to this call: other parallel code of the process keeps its own chunk size."""
    with numba.parallel_chunksize(1):
        attend(query, k_cache, v_cache, k_bits, v_bits, mode, int4, block_tables, context_lens,
               query_start_loc, window, items, groups, num_partial_rows, v_scale, out)

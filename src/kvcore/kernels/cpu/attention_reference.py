"""NumPy paged attention for mixed batches: decode tokens vectorized, prefill chunks in tiles."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvcore.kernels.cpu.threads import num_threads, run_parallel, split

# score elements per attention tile of a prefill chunk: bounds the (H, rows, keys) score matrix
TILE_ELEMENTS = 1 << 20
# padded context keys per group of decode sequences attended together: bounds a group's gathered
# K and V (2 x 4096 x Hkv x D floats, 6 MB at 3 x 64), still cache-warm when its two GEMMs read
# them; smaller groups lose more to per-call overhead and the GIL than they gain (measured)
DECODE_PART_KEYS = 4096
# exp(score) needs no shift by the row maximum while every row's maximum lies within this bound:
# no overflow (e^60 x a million keys < float32's max) and no row underflows to all zeros
_EXP_SAFE = 60.0
# a batch with fewer padded keys than this per thread attends on one thread: a hand-off and the
# GIL cost more than the work (8 x 128 keys: 16 ms per step on one thread, 24 ms on two)
_MIN_SHARE_KEYS = 2048
_local = threading.local()  # per-thread scratch buffers and the last attention plan


def load(x: np.ndarray, scale: float) -> np.ndarray:
    """Read cache entries back as float32: read value = stored * scale."""
    out = x.astype(np.float32, copy=False)
    return out * np.float32(scale) if scale != 1.0 else out


@dataclass(frozen=True, slots=True)
class DecodePart:
    """Decode tokens attended together: their rows, padded block ids, and the keys to hide."""

    rows: np.ndarray  # (s,) int64 rows of the query
    table: np.ndarray  # (s, width) int64 block ids; padding reads block 0 and is masked
    masked: np.ndarray  # (s, 1, 1, width * block_size) bool: future, padding, out of window


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sequence with more than one query token this step (a prefill chunk)."""

    q_start: int
    q_len: int
    context_len: int
    block_table: np.ndarray  # (max_blocks,) int32


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    decode_parts: list[DecodePart]
    chunks: list[Chunk]


def plan(block_tables: np.ndarray, context_lens: np.ndarray, query_start_loc: np.ndarray,
         block_size: int, sliding_window: int | None) -> AttentionPlan:
    """The index work of one step's attention, shared by all layers: the last plan (per thread)
    is reused while the batch arrays hold the same values. The values are checked here, once
    per new plan (query lengths within the context, context within the block table)."""
    key = (*[(a.shape, a.dtype.str, a.tobytes())
             for a in (block_tables, context_lens, query_start_loc)],
           block_size, sliding_window, num_threads())
    cached = getattr(_local, "plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]  # type: ignore[no-any-return]
    q_lens = np.diff(query_start_loc).astype(np.int64)
    if np.any(q_lens > context_lens):
        raise ValueError("a sequence has more query tokens than its context_lens")
    if np.any(-(-context_lens.astype(np.int64) // block_size) > block_tables.shape[1]):
        raise ValueError("context_lens exceed the blocks that block_tables can hold")
    decode = np.flatnonzero(q_lens == 1)
    # by context length, so that the sequences of a group pad to about the same width
    decode = decode[np.argsort(context_lens[decode], kind="stable")]
    parts = [_decode_part(decode[r], block_tables, context_lens, query_start_loc, block_size,
                          sliding_window)
             for r in _decode_groups(context_lens[decode], block_size, sliding_window,
                                     num_threads())]
    chunks = [Chunk(int(query_start_loc[s]), int(q_lens[s]), int(context_lens[s]),
                    block_tables[s]) for s in np.flatnonzero(q_lens > 1)]
    result = AttentionPlan(parts, chunks)
    _local.plan = (key, result)
    return result


def _decode_groups(context_lens: np.ndarray, block_size: int, sliding_window: int | None,
                   threads: int) -> list[slice]:
    """Consecutive groups of decode sequences (sorted by context length) whose padded keys
    (group size x the longest's blocks) stay within DECODE_PART_KEYS, and within an even share
    of all keys per thread (but not below _MIN_SHARE_KEYS), so that a mid-sized batch still
    gives every thread a group while a small one stays on one thread."""
    keys = -(-context_lens.astype(np.int64) // block_size) * block_size
    if sliding_window is not None:
        keys = np.minimum(keys, sliding_window + 2 * block_size)
    limit = min(DECODE_PART_KEYS, max(_MIN_SHARE_KEYS, -(-int(keys.sum()) // threads)))
    groups: list[slice] = []
    start = 0
    for end in range(1, keys.size + 1):
        if end == keys.size or (end + 1 - start) * keys[end] > limit:
            groups.append(slice(start, end))
            start = end
    return groups


def _decode_part(seqs: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray,
                 query_start_loc: np.ndarray, block_size: int,
                 sliding_window: int | None) -> DecodePart:
    ctx = context_lens[seqs].astype(np.int64)
    first_block = np.zeros(seqs.size, dtype=np.int64)
    if sliding_window is not None:
        first_block = np.maximum(ctx - sliding_window, 0) // block_size
    num_blocks = -(-ctx // block_size) - first_block
    width = int(num_blocks.max())
    block_idx = first_block[:, None] + np.arange(width)[None, :]  # (s, width)
    in_table = block_idx < (first_block + num_blocks)[:, None]
    tables = block_tables[seqs]
    table = np.take_along_axis(tables, np.minimum(block_idx, tables.shape[1] - 1), axis=1)
    table = np.maximum(np.where(in_table, table, 0), 0).astype(np.int64)
    key_pos = (first_block * block_size)[:, None] + np.arange(width * block_size)[None, :]
    q_pos = (ctx - 1)[:, None]
    masked = key_pos > q_pos  # (s, N)
    if sliding_window is not None:
        masked |= key_pos <= q_pos - sliding_window
    rows = query_start_loc[seqs].astype(np.int64)
    return DecodePart(rows, table, masked[:, None, None, :])


def attend(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, step: AttentionPlan,
           scale: float, sliding_window: int | None, k_scale: float,
           v_scale: float) -> np.ndarray:
    """Run a plan for one layer: (T, H, D) float32."""
    out = np.empty(query.shape, dtype=np.float32)  # (T, H, D)

    def decode(parts: list[DecodePart]) -> None:
        for part in parts:
            out[part.rows] = _decode(query[part.rows], k_cache, v_cache, part, scale, k_scale,
                                     v_scale)

    # interleaved over the threads: the groups grow along the sorted order
    threads = min(num_threads(), len(step.decode_parts))
    run_parallel(decode, [step.decode_parts[i::threads] for i in range(threads)])
    for c in step.chunks:
        out[c.q_start:c.q_start + c.q_len] = _chunk(
            query[c.q_start:c.q_start + c.q_len], k_cache, v_cache, c.block_table,
            c.context_len, scale, sliding_window, k_scale, v_scale)
    return out


def _decode(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, part: DecodePart,
            scale: float, k_scale: float, v_scale: float) -> np.ndarray:
    """One query token per sequence, all sequences at once: (S, H, D) -> (S, H, D).

    Vectorized over sequences, since a per-sequence loop dominates a large decode batch: the
    context blocks of every sequence are gathered into one padded (S, N, Hkv, D) tensor.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    num_keys = part.masked.shape[-1]
    keys = _gather_blocks(k_cache, part.table, "keys", k_scale)  # (S, nb, block_size, Hkv, D)
    # MLA's shared latent cache is both K and V: gather it once
    values = keys if v_cache is k_cache and v_scale == k_scale else _gather_blocks(
        v_cache, part.table, "values", v_scale)
    keys = keys.reshape(num_seqs, num_keys, num_kv_heads, head_dim).transpose(0, 2, 3, 1)
    values = values.reshape(num_seqs, num_keys, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    q = query.astype(np.float32) * np.float32(scale)
    q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = q @ keys  # (S, Hkv, G, N)
    np.copyto(scores, -np.inf, where=part.masked)
    return _softmax_weighted(scores, values).reshape(num_seqs, num_heads, head_dim)


def _gather_blocks(cache: np.ndarray, table: np.ndarray, name: str, scale: float) -> np.ndarray:
    """cache[table] as float32 (S, nb, block_size, Hkv, D); every entry of table is valid."""
    if cache.dtype != np.float32:
        return load(cache[table], scale)
    out = _workspace(name, table.size * cache[0].size).reshape(*table.shape, *cache.shape[1:])
    np.take(cache, table, axis=0, out=out, mode="clip")  # "clip": no bounds buffer, ids valid
    return load(out, scale)


def _gather(cache: np.ndarray, block_table: np.ndarray, start: int, end: int,
            scale: float) -> np.ndarray:
    """Keys (or values) at positions [start, end) of one sequence: (end - start, Hkv, D) float32."""
    block_size = cache.shape[1]
    first_block, last_block = start // block_size, -(-end // block_size)
    rows = cache[block_table[first_block:last_block]]  # (nb, block_size, Hkv, D)
    rows = rows.reshape(-1, *cache.shape[2:])
    lo = start - first_block * block_size
    return load(rows[lo:lo + end - start], scale)


def _chunk(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
           ctx: int, scale: float, sliding_window: int | None, k_scale: float,
           v_scale: float) -> np.ndarray:
    """The q_len queries of one sequence's chunk, the last of its ctx tokens: (q_len, H, D)."""
    q_len, num_heads, head_dim = query.shape
    first_pos = ctx - q_len  # position of the chunk's first query
    k_start = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
    keys = _gather(k_cache, block_table, k_start, ctx, k_scale)  # (N, Hkv, D)
    values = keys if v_cache is k_cache and v_scale == k_scale else _gather(
        v_cache, block_table, k_start, ctx, v_scale)
    # contiguous per-head K^T and V, and each tile's queries merged over the group, so every
    # product is one plain GEMM per KV head (strided or broadcast operands run far slower)
    keys_t = np.ascontiguousarray(keys.transpose(1, 2, 0))  # (Hkv, D, N)
    # V with a column of ones: the GEMM that weights the values also sums the probabilities
    values_h = np.empty((values.shape[1], values.shape[0], head_dim + 1), np.float32)  # (Hkv,N,D+1)
    values_h[..., :head_dim] = values.transpose(1, 0, 2)
    values_h[..., head_dim] = 1.0
    out = np.empty((q_len, num_heads, head_dim), dtype=np.float32)  # (q_len, H, D)
    # query rows per tile: the (H, rows, keys) score tile stays under ~4 MB, and tiles stay
    # short (<= 64 rows) so little of each causal tile is computed only to be masked
    rows_per_tile = max(16, min(64, TILE_ELEMENTS // (num_heads * (ctx - k_start))))
    starts = list(range(0, q_len, rows_per_tile))

    def tiles(part: range) -> None:
        # interleaved tiles per thread: causal tiles grow in cost along the chunk
        for t0 in starts[part.start::part.step]:
            t1 = min(q_len, t0 + rows_per_tile)
            # the keys this tile can see at all: causal end, and the window's start
            hi = first_pos + t1 - k_start
            lo = 0 if sliding_window is None else max(
                0, first_pos + t0 - sliding_window + 1 - k_start)
            out[t0:t1] = _tile(query[t0:t1], keys_t[:, :, lo:hi], values_h[:, lo:hi],
                               first_pos + t0, k_start + lo, scale, sliding_window)

    num_parts = len(split(len(starts), min_part=2))
    run_parallel(tiles, [range(p, len(starts), num_parts) for p in range(num_parts)])
    return out


def _tile(query: np.ndarray, keys_t: np.ndarray, values: np.ndarray, first_query: int,
          first_key: int, scale: float, sliding_window: int | None) -> np.ndarray:
    """Queries (rows, H, D) at first_query.. over keys_t (Hkv, D, n) / values (Hkv, n, D + 1, a
    last column of ones) at first_key..: (rows, H, D). The group's queries of a KV head form one
    GEMM's rows."""
    rows, num_heads, head_dim = query.shape
    num_kv_heads, _, num_keys = keys_t.shape
    group = num_heads // num_kv_heads
    q = query.astype(np.float32) * np.float32(scale)
    q = q.reshape(rows, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    q = np.ascontiguousarray(q).reshape(num_kv_heads, group * rows, head_dim)
    scores = _workspace("scores", num_kv_heads * group * rows * num_keys).reshape(
        num_kv_heads, group * rows, num_keys)  # (Hkv, G * rows, keys)
    np.matmul(q, keys_t, out=scores)
    _mask_tile(scores.reshape(num_kv_heads, group, rows, num_keys), first_query, first_key,
               sliding_window)
    o = _softmax_weighted_ones(scores, values)  # (Hkv, G * rows, D)
    return o.reshape(num_kv_heads, group, rows, head_dim).transpose(2, 0, 1, 3).reshape(
        rows, num_heads, head_dim)


def _mask_tile(scores: np.ndarray, first_query: int, first_key: int,
               sliding_window: int | None) -> None:
    """Set -inf where query (first_query + row) may not see key (first_key + column): the
    future, and keys at or behind the window. Only the columns that can hold such keys are
    touched: the tile's diagonal band and, with a window, its left edge."""
    rows, num_keys = scores.shape[-2:]
    q_pos = np.arange(first_query, first_query + rows)[:, None]
    c0 = max(0, first_query + 1 - first_key)  # first column some row must not see (future)
    if c0 < num_keys:
        key_pos = np.arange(first_key + c0, first_key + num_keys)[None, :]
        np.copyto(scores[..., c0:], -np.inf, where=key_pos > q_pos)
    if sliding_window is not None:
        # columns some row sees as too old: key <= last query - window
        c1 = min(num_keys, first_query + rows - sliding_window - first_key)
        if c1 > 0:
            key_pos = np.arange(first_key, first_key + c1)[None, :]
            np.copyto(scores[..., :c1], -np.inf, where=key_pos <= q_pos - sliding_window)


def _softmax_weighted(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(scores) @ values, in place on scores; masked scores are -inf and every row keeps
    at least one key. Normalizes the (small) output rather than the (large) probabilities, and
    skips the shift by the row maximum (a pass over the scores) when no row needs it."""
    _exp_shifted(scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    out = scores @ values
    out /= denominator
    return out


def _softmax_weighted_ones(scores: np.ndarray, values: np.ndarray) -> np.ndarray:
    """softmax(scores) @ values[..., :-1] where values' last column is ones, in place on scores:
    the GEMM yields the denominator too, and the shift by the row maximum (one more pass over
    the scores) is skipped when no row needs it."""
    _exp_shifted(scores)
    weighted = scores @ values  # (..., rows, D + 1)
    out = weighted[..., :-1]
    out /= weighted[..., -1:]
    return out


def _exp_shifted(scores: np.ndarray) -> None:
    """exp(scores - c) in place, c constant per row: the row maximum, or 0 while every row's
    maximum lies within +-_EXP_SAFE (softmax is unchanged by c; exp neither overflows nor
    underflows a whole row to zero)."""
    row_max = scores.max(axis=-1, keepdims=True)
    if not (row_max.min() > -_EXP_SAFE and row_max.max() < _EXP_SAFE):
        scores -= row_max
    np.exp(scores, out=scores)


def _workspace(name: str, size: int) -> np.ndarray:
    """A reused float32 scratch buffer of `size` elements, per name and thread: fresh
    multi-megabyte score tiles and gathered contexts every layer cost more in page faults than
    the GEMMs that use them."""
    buf: np.ndarray | None = getattr(_local, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1 << 16), dtype=np.float32)
        setattr(_local, name, buf)
    return buf[:size]

"""NumPy reference kernels: the CPU path of the forward pass and the oracle for the CUDA kernels."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

from kvcore.kernels.layer_ops import rms_norm, rope, rope_cos_sin, rope_inv_freq, silu_and_mul
from kvcore.kernels.parallel import run_parallel, split

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite e4m3fn value; casts saturate here (as CUDA's __NV_SATFINITE)
# score elements per attention tile of a prefill chunk: bounds the (H, rows, keys) score matrix
_TILE_ELEMENTS = 1 << 20
_scratch = threading.local()


def _store(x: np.ndarray, dtype: np.dtype, scale: float) -> np.ndarray:
    """Convert activations to the cache's storage dtype: stored value = x / scale."""
    if dtype == FP8_DTYPE:
        return np.clip(x.astype(np.float32) / np.float32(scale), -FP8_MAX, FP8_MAX).astype(dtype)
    if scale != 1.0:
        x = x / np.float32(scale)
    return x.astype(dtype, copy=False)


def _load(x: np.ndarray, scale: float) -> np.ndarray:
    """Read cache entries back as float32: read value = stored * scale."""
    out = x.astype(np.float32, copy=False)
    return out * np.float32(scale) if scale != 1.0 else out


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write this step's K/V rows into their cache slots (slot = block_id * block_size + offset).

    key/value (T, Hkv, D); caches (num_blocks, block_size, Hkv, D); slot_mapping (T,), -1 = skip.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {value.shape} differs from key shape {key.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not hold "
                         f"({num_kv_heads}, {head_dim}) heads")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != ({num_tokens},)")
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    if slots.size and int(slots.max()) >= k_cache.shape[0] * block_size:
        raise ValueError(f"slot {int(slots.max())} is outside a cache of "
                         f"{k_cache.shape[0]} blocks x {block_size}")
    block_ids, offsets = slots // block_size, slots % block_size
    k_cache[block_ids, offsets] = _store(key[valid], k_cache.dtype, k_scale)
    v_cache[block_ids, offsets] = _store(value[valid], v_cache.dtype, v_scale)


def _first_key(context_len: int, q_len: int, sliding_window: int | None) -> int:
    """The earliest key position any query of this chunk may attend to."""
    if sliding_window is None:
        return 0
    return max(0, context_len - q_len - sliding_window + 1)


def _gather(cache: np.ndarray, block_table: np.ndarray, start: int, end: int,
            scale: float) -> np.ndarray:
    """Keys (or values) at positions [start, end) of one sequence: (end - start, Hkv, D) float32."""
    block_size = cache.shape[1]
    first_block, last_block = start // block_size, -(-end // block_size)
    rows = cache[block_table[first_block:last_block]]  # (nb, block_size, Hkv, D)
    rows = rows.reshape(-1, *cache.shape[2:])
    lo = start - first_block * block_size
    return _load(rows[lo:lo + end - start], scale)


def _check_attention_args(query: np.ndarray, k_cache: np.ndarray, block_tables: np.ndarray,
                          context_lens: np.ndarray, query_start_loc: np.ndarray) -> None:
    num_seqs = context_lens.shape[0]
    if query.ndim != 3 or k_cache.ndim != 4 or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query {query.shape} and cache {k_cache.shape} shapes do not match")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads "
                         f"({k_cache.shape[2]})")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc {query_start_loc.shape} / block_tables "
                         f"{block_tables.shape} do not match {num_seqs} sequences")
    if int(query_start_loc[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])}, "
                         f"query has {query.shape[0]} rows")
    q_lens = np.diff(query_start_loc)
    if np.any(q_lens > context_lens):
        raise ValueError("a sequence has more query tokens than its context_lens")
    if np.any(-(-context_lens.astype(np.int64) // k_cache.shape[1]) > block_tables.shape[1]):
        raise ValueError("context_lens exceed the blocks that block_tables can hold")


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                    block_tables: np.ndarray, context_lens: np.ndarray,
                    query_start_loc: np.ndarray, scale: float, sliding_window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over the paged cache.

    Query i of sequence s (q_len = qsl[s+1] - qsl[s]) sits at position context_lens[s] - q_len + i
    and attends the keys at positions p' <= p (and p' > p - sliding_window). Returns (T, H, D).
    """
    _check_attention_args(query, k_cache, block_tables, context_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    out = np.empty((num_tokens, num_heads, head_dim), dtype=np.float32)  # (T, H, D)
    q_lens = np.diff(query_start_loc).astype(np.int64)
    decode = np.flatnonzero(q_lens == 1)

    def decode_part(part: range) -> None:
        seqs = decode[part.start:part.stop]
        rows = query_start_loc[seqs].astype(np.int64)
        out[rows] = _decode_attention(query[rows], k_cache, v_cache, block_tables[seqs],
                                      context_lens[seqs].astype(np.int64), scale,
                                      sliding_window, k_scale, v_scale)

    run_parallel(decode_part, split(decode.size, min_part=8))
    for s in np.flatnonzero(q_lens > 1):
        q_start, q_len, ctx = int(query_start_loc[s]), int(q_lens[s]), int(context_lens[s])
        out[q_start:q_start + q_len] = _chunk_attention(
            query[q_start:q_start + q_len], k_cache, v_cache, block_tables[s], ctx, scale,
            sliding_window, k_scale, v_scale)
    return out.astype(query.dtype, copy=False)


def _chunk_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                     block_table: np.ndarray, ctx: int, scale: float,
                     sliding_window: int | None, k_scale: float, v_scale: float) -> np.ndarray:
    """The q_len queries of one sequence's chunk, the last of its ctx tokens: (q_len, H, D)."""
    q_len, num_heads, head_dim = query.shape
    first_pos = ctx - q_len  # position of the chunk's first query
    k_start = _first_key(ctx, q_len, sliding_window)
    keys = _gather(k_cache, block_table, k_start, ctx, k_scale)  # (N, Hkv, D)
    values = _gather(v_cache, block_table, k_start, ctx, v_scale)
    # contiguous per-head K^T and V, and each tile's queries merged over the group, so every
    # product is one plain GEMM per KV head (strided or broadcast operands run far slower)
    keys_t = np.ascontiguousarray(keys.transpose(1, 2, 0))  # (Hkv, D, N)
    values_h = np.ascontiguousarray(values.transpose(1, 0, 2))  # (Hkv, N, D)
    out = np.empty((q_len, num_heads, head_dim), dtype=np.float32)  # (q_len, H, D)
    # query rows per tile: the (H, rows, keys) score tile stays around 4 MB
    rows_per_tile = max(16, _TILE_ELEMENTS // (num_heads * (ctx - k_start)))
    starts = list(range(0, q_len, rows_per_tile))

    def tiles(part: range) -> None:
        # interleaved tiles per thread: causal tiles grow in cost along the chunk
        for t0 in starts[part.start::part.step]:
            t1 = min(q_len, t0 + rows_per_tile)
            # the keys this tile can see at all: causal end, and the window's start
            hi = first_pos + t1 - k_start
            lo = 0 if sliding_window is None else max(
                0, first_pos + t0 - sliding_window + 1 - k_start)
            out[t0:t1] = _attention_tile(query[t0:t1], keys_t[:, :, lo:hi], values_h[:, lo:hi],
                                         first_pos + t0, k_start + lo, scale, sliding_window)

    num_parts = len(split(len(starts), min_part=2))
    run_parallel(tiles, [range(p, len(starts), num_parts) for p in range(num_parts)])
    return out


def _attention_tile(query: np.ndarray, keys_t: np.ndarray, values: np.ndarray,
                    first_query: int, first_key: int, scale: float,
                    sliding_window: int | None) -> np.ndarray:
    """Queries (rows, H, D) at first_query.. over keys_t (Hkv, D, n) / values (Hkv, n, D) at
    first_key..: (rows, H, D). The group's queries of a KV head form one GEMM's rows."""
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
    o = _softmax_weighted(scores, values)  # (Hkv, G * rows, D)
    return o.reshape(num_kv_heads, group, rows, head_dim).transpose(2, 0, 1, 3).reshape(
        rows, num_heads, head_dim)


def _workspace(name: str, size: int) -> np.ndarray:
    """A reused float32 scratch buffer of `size` elements, per name and thread: fresh
    multi-megabyte score tiles and gathered contexts every layer cost more in page faults than
    the GEMMs that use them."""
    buf: np.ndarray | None = getattr(_scratch, name, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 1 << 16), dtype=np.float32)
        setattr(_scratch, name, buf)
    return buf[:size]


def _gather_blocks(cache: np.ndarray, table: np.ndarray, name: str, scale: float) -> np.ndarray:
    """cache[table] as float32 (S, nb, block_size, Hkv, D); every entry of table is valid."""
    if cache.dtype != np.float32:
        return _load(cache[table], scale)
    out = _workspace(name, table.size * cache[0].size).reshape(*table.shape, *cache.shape[1:])
    np.take(cache, table, axis=0, out=out, mode="clip")  # "clip": no bounds buffer, ids valid
    return _load(out, scale)


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
    at least one key. Normalizes the (small) output rather than the (large) probabilities."""
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denominator = scores.sum(axis=-1, keepdims=True)
    out = scores @ values
    out /= denominator
    return out


def _decode_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      block_tables: np.ndarray, context_lens: np.ndarray, scale: float,
                      sliding_window: int | None, k_scale: float, v_scale: float) -> np.ndarray:
    """One query token per sequence, all sequences at once: (S, H, D) -> (S, H, D).

    Vectorized over sequences, since a per-sequence loop dominates a large decode batch: the
    context blocks of every sequence are gathered into one padded (S, N, Hkv, D) tensor.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    first_block = np.zeros(num_seqs, dtype=np.int64)
    if sliding_window is not None:
        first_block = np.maximum(context_lens - sliding_window, 0) // block_size
    num_blocks = -(-context_lens // block_size) - first_block
    width = int(num_blocks.max())
    block_idx = first_block[:, None] + np.arange(width)[None, :]  # (S, nb)
    in_table = block_idx < (first_block + num_blocks)[:, None]
    # padding entries (-1, or beyond the table) read block 0 and are masked out below
    table = np.take_along_axis(block_tables, np.minimum(block_idx, block_tables.shape[1] - 1),
                               axis=1)
    table = np.where(in_table, table, 0)
    table = np.maximum(table, 0)
    keys = _gather_blocks(k_cache, table, "keys", k_scale)  # (S, nb, block_size, Hkv, D)
    values = _gather_blocks(v_cache, table, "values", v_scale)
    num_keys = width * block_size
    keys = keys.reshape(num_seqs, num_keys, num_kv_heads, head_dim).transpose(0, 2, 3, 1)
    values = values.reshape(num_seqs, num_keys, num_kv_heads, head_dim).transpose(0, 2, 1, 3)
    q = query.astype(np.float32) * np.float32(scale)
    q = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = q @ keys  # (S, Hkv, G, N)
    key_pos = (first_block * block_size)[:, None] + np.arange(num_keys)[None, :]
    q_pos = (context_lens - 1)[:, None]
    masked = key_pos > q_pos  # (S, N)
    if sliding_window is not None:
        masked |= key_pos <= q_pos - sliding_window
    np.copyto(scores, -np.inf, where=masked[:, None, None, :])
    o = _softmax_weighted(scores, values)  # (S, Hkv, G, D)
    return o.reshape(num_seqs, num_heads, head_dim)


def copy_blocks(k_caches: list[np.ndarray], v_caches: list[np.ndarray],
                block_mapping: np.ndarray) -> None:
    """Copy whole blocks src -> dst in every layer; block_mapping (M, 2) int64."""
    if block_mapping.size == 0:
        return
    if block_mapping.ndim != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be (M, 2), got {block_mapping.shape}")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*k_caches, *v_caches):
        if int(block_mapping.max()) >= cache.shape[0] or int(block_mapping.min()) < 0:
            raise ValueError(f"block_mapping holds a block id outside [0, {cache.shape[0]})")
        cache[dst] = cache[src]


__all__ = ["FP8_DTYPE", "FP8_MAX", "copy_blocks", "paged_attention", "reshape_and_cache",
           "rms_norm", "rope", "rope_cos_sin", "rope_inv_freq", "silu_and_mul"]

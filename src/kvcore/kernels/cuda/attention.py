"""Planning of paged attention launches: checks, partitions, tiles and shared memory sizes.

A mixed batch gets the decode kernel for its one-token sequences (split into partitions and
reduced when contexts are long) and the prefill kernel for its chunks; each kernel skips the
other kind of sequence, so both run over the whole batch without reordering it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.kernels.cuda.launch import (
    SMEM_LIMIT,
    Backend,
    Launch,
    batch_shape,
    cache_suffix_of,
    check_contiguous,
    suffix_of,
    upload_seq_metadata,
)
from kvcore.kernels.cuda.occupancy import PARTITION_TOKENS, blocks_per_sm, split_grid
from kvcore.kernels.cuda.variants import AttentionShape, pick

_CTYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "fp8": "__nv_fp8_e4m3"}
_PREFILL_THREADS = 128
DECODE_HEAD_DIMS = (16, 32, 64, 128, 256)  # head_dim values the decode kernel compiles for
PREFILL_TC_ROWS = 64  # query rows (positions x group) per tensor-core prefill block
MAX_GROUP = 32  # largest GQA group (query heads per KV head) the decode kernel compiles for
DECODE_TC_KEYS = 64  # keys per staged tile of paged_attention_decode_tc.cu
DECODE_TC_THREADS = 128
# sm_90 registers per thread of paged_attention_decode_tc.cu by (head_dim, cache bytes): upper
# bounds of what compile_check reports for groups up to 16 (a compile test holds them to it);
# other head_dims count as the 255 maximum
DECODE_TC_REGISTERS = {(64, 1): 120, (64, 2): 144, (128, 1): 168, (128, 2): 168,
                       (256, 1): 255, (256, 2): 255}
PREFILL_MMA_ROWS = 128  # query rows (positions x group) per register-tile prefill block
PREFILL_MMA_THREADS = 256


def decode_defines(head_dim: int, group: int, suffix: str, cache_suffix: str) -> tuple[str, ...]:
    """The -D options selecting the decode kernel's compiled variant."""
    return (f"KVC_HEAD_DIM={head_dim}", f"KVC_GROUP={group}", f"KVC_SCALAR={_CTYPES[suffix]}",
            f"KVC_CACHE={_CTYPES[cache_suffix]}")


def decode_layout(group: int) -> tuple[int, int]:
    """(warps, head warps) of the decode kernel (KVC_DECODE_WARPS, kHW): the head warps split
    the group's query heads, warps / head warps walk different KV blocks."""
    warps = 8 if group > 4 else 4
    return warps, min(group, warps)


def decode_threads(group: int) -> int:
    """KVC_DECODE_THREADS: 8 warps for groups over 4, else 4."""
    return 32 * decode_layout(group)[0]


def decode_smem_bytes(group: int, head_dim: int) -> int:
    """Merge records (fp32 o, m, l) per (warp, head of the warp) when several warps walk
    different KV blocks; none when one warp walks them all."""
    warps, head_warps = decode_layout(group)
    if warps // head_warps == 1:
        return 0
    return 4 * warps * -(-group // head_warps) * (head_dim + 2)


def decode_tc_blocks_per_sm(head_dim: int, cache_itemsize: int) -> int:
    """paged_attention_decode_tc.cu's blocks per SM from its registers and kSmemBytes."""
    registers = DECODE_TC_REGISTERS.get((head_dim, cache_itemsize), 255)
    return blocks_per_sm(DECODE_TC_THREADS, registers,
                         decode_tc_smem_bytes(head_dim, cache_itemsize))


def decode_tc_smem_bytes(head_dim: int, cache_itemsize: int) -> int:
    """paged_attention_decode_tc.cu's kSmemBytes: two buffers of 64-key K and V tiles (raw
    cache rows padded by 16 bytes), reused after the last tile by the 4 warps' fp32 merge
    records (16 rows of head_dim + 4)."""
    stage = 2 * 2 * DECODE_TC_KEYS * (head_dim * cache_itemsize + 16)
    merge = 4 * 16 * (head_dim + 4) * 4
    return max(stage, merge)


def prefill_mma_smem_bytes(head_dim: int, cache_itemsize: int) -> int:
    """paged_attention_prefill_mma.cu's kSmemBytes: two buffers of 64-key K and V tiles."""
    return 2 * 2 * DECODE_TC_KEYS * (head_dim * cache_itemsize + 16)


def prefill_tc_defines(head_dim: int, suffix: str, cache_suffix: str) -> tuple[str, ...]:
    """The -D options selecting the tensor-core prefill kernel's compiled variant."""
    return (f"KVC_HEAD_DIM={head_dim}", f"KVC_SCALAR={_CTYPES[suffix]}",
            f"KVC_CACHE={_CTYPES[cache_suffix]}")


def prefill_tc_smem_bytes(head_dim: int) -> int:
    """paged_attention_prefill_tc.cu's kSmemBytes: Q, K, V tiles (16-bit, rows padded by 8),
    scores (fp32, +4), probabilities (16-bit, +8), output (fp32, +4)."""
    rows, keys = PREFILL_TC_ROWS, 32 if head_dim > 128 else 64
    return (2 * (rows + 2 * keys) * (head_dim + 8) + 4 * rows * (keys + 4)
            + 2 * rows * (keys + 8) + 4 * rows * (head_dim + 4))


def prefill_smem_bytes(group: int, head_dim: int, q_tile: int, k_tile: int) -> int:
    rows = q_tile * group
    return 4 * (2 * rows * head_dim + k_tile * (head_dim + 1) + k_tile * head_dim
                + rows * k_tile + 3 * rows)


def prefill_tiles(group: int, head_dim: int) -> tuple[int, int]:
    """(q_tile, k_tile): about 16 query rows per block, the largest key tile that fits."""
    for k_tile in (32, 16, 8):
        for q_tile in range(max(1, 16 // group), 0, -1):
            if prefill_smem_bytes(group, head_dim, q_tile, k_tile) <= SMEM_LIMIT:
                return q_tile, k_tile
    raise ValueError(f"GQA group {group} x head_dim {head_dim} exceeds the prefill kernel's "
                     "shared memory")


def reduce_launch(backend: Backend, defines: tuple[str, ...], out: Any,
                  scratch: tuple[Any, Any, Any], metadata: tuple[Any, Any, Any], block_size: int,
                  window: int, partition_tokens: int) -> Launch:
    """paged_attention_reduce over the partials `scratch` ((S, H, P, D) outputs, (S, H, P) max
    logits and exp sums): each sequence's own partitions, recounted from its span."""
    tmp_out, max_logits, exp_sums = scratch
    num_seqs, num_heads, parts, head_dim = tmp_out.shape
    _, context_lens, query_start_loc = metadata
    return Launch(backend.function("paged_attention_decode.cu", "paged_attention_reduce", defines),
                  (num_heads, num_seqs), (128,),
                  (out, tmp_out, max_logits, exp_sums, query_start_loc, context_lens,
                   *(np.int32(v) for v in (num_heads, head_dim, parts, block_size, window,
                                           partition_tokens))),
                  4 * (parts + 1))


def plan_paged_attention(backend: Backend, query: Any, k_cache: Any, v_cache: Any,
                         block_tables: Any, context_lens: Any, query_start_loc: Any, scale: float,
                         sliding_window: int | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0, *, partition_tokens: int = PARTITION_TOKENS,
                         host_metadata: bool | None = None) -> tuple[Any, list[Launch]]:
    """Check the arguments and prepare the launches; returns (out (T, H, D), launches).

    Running the launches in order fills `out`; they never synchronize. With host (NumPy)
    query_start_loc and context_lens (`host_metadata` None = decide by type), the grids fit the
    batch exactly and the values are checked. With device arrays nothing is read back: the grids
    are sized from the shapes alone (the kernels skip what they do not own), so a step needs no
    sync and its launches can be captured in a CUDA graph.
    """
    if query.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"query {query.shape} must be (T, H, D) and k_cache {k_cache.shape}"
                         f" / v_cache {v_cache.shape} equal (num_blocks, block_size, Hkv, D)")
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {query.shape} does not fit cache {k_cache.shape}: head_dim "
                         "must match and H be a multiple of Hkv")
    if head_dim not in DECODE_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {DECODE_HEAD_DIMS} (the compiled variants), "
                         f"got {head_dim}")
    if num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"GQA group (num_heads / num_kv_heads) must be <= {MAX_GROUP}, got "
                         f"{num_heads // num_kv_heads}")
    if partition_tokens < 1:
        raise ValueError(f"partition_tokens must be >= 1, got {partition_tokens}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError("k_cache and v_cache must share their dtype")
    for name, value in (("scale", scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    suffix = suffix_of("query", query)
    cache_suffix = cache_suffix_of("k_cache", k_cache, suffix)
    for name, array in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_contiguous(name, array)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    window = int(sliding_window or 0)
    shape = batch_shape(backend, block_tables, context_lens, query_start_loc, num_tokens,
                        block_size, host_metadata, window)
    num_seqs, max_blocks = shape.num_seqs, shape.max_blocks
    decode_span, max_q_len = shape.decode_span, shape.max_q_len
    has_prefill = max_q_len > 1
    xp = backend.xp
    if num_tokens == 0 or num_seqs == 0:
        return xp.empty((num_tokens, num_heads, head_dim), dtype=query.dtype), []
    block_tables, context_lens, query_start_loc = upload_seq_metadata(
        xp, block_tables, context_lens, query_start_loc, num_seqs)
    out = xp.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)  # (T, H, D)
    group = num_heads // num_kv_heads
    metadata = (block_tables, context_lens, query_start_loc)
    scales = (np.float32(scale), np.float32(k_scale), np.float32(v_scale))
    launches: list[Launch] = []
    # the kernels the table picks (variants.py): one for the decode rows, one for the chunks
    attn_shape = AttentionShape(suffix, cache_suffix, group, head_dim, block_size)
    decode_source = pick("decode", attn_shape).source
    prefill_source = pick("prefill", attn_shape).source
    register_tile = decode_source == "paged_attention_decode_tc.cu"
    if decode_span > 0:
        span_blocks = -(-decode_span // block_size) + (1 if window else 0)  # window: +1 partial
        # partitions fixed by each sequence's own span (kv_split): the grid takes the most any
        # decode row of the batch needs; blocks past a sequence's own count return at once
        parts = split_grid(span_blocks, block_size, partition_tokens)
        stats_shape = (num_seqs, num_heads, parts) if parts > 1 else (1,)
        tmp_out = xp.empty((*stats_shape, head_dim), np.float32)  # (S, H, P, D) partials
        max_logits = xp.empty(stats_shape, np.float32)  # (S, H, P)
        exp_sums = xp.empty(stats_shape, np.float32)
        defines = decode_defines(head_dim, group, suffix, cache_suffix)
        if register_tile:
            # the group's query heads as the rows of mma.sync tiles, K/V staged asynchronously
            tc_ints = (num_heads, num_kv_heads, block_size.bit_length() - 1, max_blocks, parts,
                       partition_tokens, window)
            launches.append(Launch(
                backend.function("paged_attention_decode_tc.cu", "paged_attention_decode_tc",
                                 defines),
                (num_kv_heads, num_seqs, parts), (DECODE_TC_THREADS,),
                (out, tmp_out, max_logits, exp_sums, query, k_cache, v_cache, *metadata,
                 *(np.int32(v) for v in tc_ints), *scales),
                decode_tc_smem_bytes(head_dim, k_cache.dtype.itemsize)))
        elif decode_source == "paged_attention_prefill_tc.cu":
            # the group's query heads as the rows of a tensor-core tile: K/V staged once per
            # block with every thread loading distinct bytes, no per-head conversions
            tc_ints = (num_heads, num_kv_heads, block_size, max_blocks, window, parts,
                       partition_tokens)
            launches.append(Launch(
                backend.function("paged_attention_prefill_tc.cu", "paged_attention_prefill_tc",
                                 prefill_tc_defines(head_dim, suffix, cache_suffix)),
                (num_kv_heads, num_seqs, parts), (_PREFILL_THREADS,),
                (out, query, k_cache, v_cache, *metadata, tmp_out, max_logits, exp_sums,
                 *(np.int32(v) for v in tc_ints), *scales),
                prefill_tc_smem_bytes(head_dim)))
        else:
            decode_ints = (num_heads, num_kv_heads, block_size, max_blocks, parts,
                           partition_tokens, window)
            launches.append(Launch(
                backend.function("paged_attention_decode.cu", "paged_attention_decode", defines),
                (num_kv_heads, num_seqs, parts), (decode_threads(group),),
                (out, tmp_out, max_logits, exp_sums, query, k_cache, v_cache, *metadata,
                 *(np.int32(v) for v in decode_ints), *scales),
                decode_smem_bytes(group, head_dim)))
        if parts > 1:
            launches.append(reduce_launch(backend, defines, out, (tmp_out, max_logits, exp_sums),
                                          metadata, block_size, window, partition_tokens))
    if has_prefill and prefill_source == "paged_attention_prefill_mma.cu":
        # register tiles: 128 query rows per block, K/V staged asynchronously
        mma_ints = (num_heads, num_kv_heads, block_size.bit_length() - 1, max_blocks, window)
        launches.append(Launch(
            backend.function("paged_attention_prefill_mma.cu", "paged_attention_prefill_mma",
                             prefill_tc_defines(head_dim, suffix, cache_suffix)),
            (num_kv_heads, num_seqs, -(-max_q_len // (PREFILL_MMA_ROWS // group))),
            (PREFILL_MMA_THREADS,),
            (out, query, k_cache, v_cache, *metadata, *(np.int32(v) for v in mma_ints), *scales),
            prefill_mma_smem_bytes(head_dim, k_cache.dtype.itemsize)))
    elif has_prefill and prefill_source == "paged_attention_prefill_tc.cu":
        unused = xp.empty((1,), np.float32)  # the decode-mode partial outputs
        tc_ints = (num_heads, num_kv_heads, block_size, max_blocks, window, 0, partition_tokens)
        launches.append(Launch(
            backend.function("paged_attention_prefill_tc.cu", "paged_attention_prefill_tc",
                             prefill_tc_defines(head_dim, suffix, cache_suffix)),
            (num_kv_heads, num_seqs, -(-max_q_len // (PREFILL_TC_ROWS // group))),
            (_PREFILL_THREADS,),
            (out, query, k_cache, v_cache, *metadata, unused, unused, unused,
             *(np.int32(v) for v in tc_ints), *scales),
            prefill_tc_smem_bytes(head_dim)))
    elif has_prefill:  # paged_attention_prefill.cu: fp32 activations
        q_tile, k_tile = prefill_tiles(group, head_dim)
        num_tiles = -(-max_q_len // q_tile)
        ints = (num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_tile, k_tile,
                window)
        launches.append(Launch(
            backend.function("paged_attention_prefill.cu",
                             f"paged_attention_prefill_{suffix}_{cache_suffix}"),
            (num_kv_heads, num_seqs, num_tiles), (_PREFILL_THREADS,),
            (out, query, k_cache, v_cache, *metadata, *(np.int32(v) for v in ints), *scales),
            prefill_smem_bytes(group, head_dim, q_tile, k_tile)))
    return out, launches


"""Planning of paged attention launches over an int4 cache (sealed int4 blocks and fp16 window
blocks, chosen per block by window_slot; layout: kv_int4).

Decode rows run paged_attention_decode_tc.cu and prefill chunks paged_attention_prefill_mma.cu,
both compiled with KVC_INT4: they stage the packed rows by cp.async (about a quarter of the fp16
bytes) and unpack them in registers into their 16-bit tiles (kv_int4_stage.cuh). Every GQA group
takes the register-tile decode kernel; fp16 / bf16 activations, head_dim 64 or 128, power-of-two
block sizes from 8 on.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.kernels.cuda.attention import (
    DECODE_TC_KEYS,
    DECODE_TC_THREADS,
    MAX_GROUP,
    PREFILL_MMA_ROWS,
    PREFILL_MMA_THREADS,
    decode_defines,
    reduce_launch,
)
from kvcore.kernels.cuda.kv_int4 import INT4_MIN_BLOCK_SIZE, check_int4_cache
from kvcore.kernels.cuda.launch import (
    Backend,
    Launch,
    batch_shape,
    check_contiguous,
    suffix_of,
    upload_seq_metadata,
)
from kvcore.kernels.cuda.occupancy import PARTITION_TOKENS, split_grid
from kvcore.kernels.cuda.variants import PREFILL_MMA_MAX_HEAD_DIM

INT4_HEAD_DIMS = (64, 128)  # 256 would need 186 KB of shared memory: over sm_80's 163
_CTYPES = {"f16": "__half", "bf16": "__nv_bfloat16"}
# sm_90 registers per thread of the KVC_INT4 decode variants by head_dim: upper bounds of what
# compile_check reports for GQA groups 1 to 32 (a compile test holds them to it; head_dim 128
# builds for 2 resident blocks, as its shared memory allows)
INT4_DECODE_REGISTERS = {64: 170, 128: 200}


def int4_raw_bytes(head_dim: int, group: int) -> int:
    """Int4Tile::kBytes (kv_int4_stage.cuh): one buffer of a 64-key tile's packed rows: K and V
    codes, V scale and zero words per key, the K scales and zeros of 9 blocks, and the 9 blocks'
    records (two row addresses and a kind: 24 bytes each)."""
    keys, nib, n = DECODE_TC_KEYS, head_dim // 2, head_dim // group
    words = n // 2 if n >= 2 else 1
    blocks = keys // INT4_MIN_BLOCK_SIZE + 1
    records = 2 * keys * nib + keys * 2 * words * 4 + blocks * 4 * head_dim
    return -(-(records + blocks * 24) // 16) * 16


def int4_tile_global_bytes(head_dim: int, group: int, block_size: int = 16) -> int:
    """Global bytes one 64-key tile of sealed blocks stages (block-aligned): K and V nibbles,
    each key's V scales and zeros, each block's K scales and zeros (2 x head_dim halves)."""
    keys, n = DECODE_TC_KEYS, head_dim // group
    words = n // 2 if n >= 2 else 1  # 4-byte copies: one group's scale comes with a neighbour
    return keys * head_dim + keys * 2 * words * 4 + keys // block_size * 4 * head_dim


def int4_tiles_bytes(head_dim: int, group: int) -> int:
    """The 16-bit K/V tiles of both buffers and their packed rows' buffers."""
    return 2 * 2 * DECODE_TC_KEYS * (head_dim * 2 + 16) + 2 * int4_raw_bytes(head_dim, group)


def int4_decode_smem_bytes(head_dim: int, group: int) -> int:
    """paged_attention_decode_tc.cu's kSmemBytes with KVC_INT4 (the merge records reuse it)."""
    return max(int4_tiles_bytes(head_dim, group), 4 * 16 * (head_dim + 4) * 4)


def int4_defines(head_dim: int, suffix: str, group: int, gqa_group: int | None) -> tuple[str, ...]:
    """-D options of the int4 variants: decode (gqa_group given) or prefill."""
    gqa = () if gqa_group is None else (f"KVC_GROUP={gqa_group}",)
    return (f"KVC_HEAD_DIM={head_dim}", *gqa, f"KVC_SCALAR={_CTYPES[suffix]}", "KVC_INT4",
            f"KVC_INT4_GROUP={group}")


def check_int4_limits(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      group: int) -> None:
    """ValueError naming the first value that the CUDA int4 kernels do not compile for (the
    engine checks a model against these before it allocates an int4 cache on cuda)."""
    if head_dim not in INT4_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: an int4 KV cache on cuda needs head_dim in "
                         f"{INT4_HEAD_DIMS}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads: an int4 KV "
                         f"cache on cuda needs a GQA group (heads per KV head) of at most "
                         f"{MAX_GROUP}")
    if block_size < INT4_MIN_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size}: an int4 KV cache on cuda needs a power of "
                         f"two >= {INT4_MIN_BLOCK_SIZE}")
    if group <= 0 or group % 16 or head_dim % group:
        # kv_int4_stage.cuh stages a key's value params in its row's chunk items: groups of 8
        # would need more copies than a row has chunks (its static_assert)
        raise ValueError(f"int4 group {group}: an int4 KV cache on cuda needs a multiple of 16 "
                         f"dividing head_dim {head_dim}")


def plan_int4_attention(backend: Backend, query: Any, k_cache: Any, v_cache: Any,
                        k_window: Any, v_window: Any, window_slot: Any, block_tables: Any,
                        context_lens: Any, query_start_loc: Any, scale: float,
                        sliding_window: int | None, group: int, *,
                        partition_tokens: int = PARTITION_TOKENS,
                        host_metadata: bool | None = None) -> tuple[Any, list[Launch]]:
    """Check the arguments and prepare the launches; returns (out (T, H, D), launches), as
    attention.plan_paged_attention (host metadata sizes the grids exactly, device
    metadata from the shapes alone)."""
    suffix = suffix_of("query", query)
    if suffix == "f32":
        raise ValueError("an int4 cache on CUDA needs float16 or bfloat16 activations, got "
                         "float32 query")
    block_size, num_kv_heads, head_dim = check_int4_cache(k_cache, v_cache, k_window, v_window,
                                                          window_slot, group)
    if query.ndim != 3 or query.shape[2] != head_dim or query.shape[1] % num_kv_heads:
        raise ValueError(f"query {query.shape} must be (T, H, {head_dim}) with H a multiple of "
                         f"{num_kv_heads}")
    num_tokens, num_heads, _ = query.shape
    gqa = num_heads // num_kv_heads
    check_int4_limits(block_size, num_heads, num_kv_heads, head_dim, group)
    if not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if partition_tokens < 1:
        raise ValueError(f"partition_tokens must be >= 1, got {partition_tokens}")
    check_contiguous("query", query)
    window = int(sliding_window or 0)
    shape = batch_shape(backend, block_tables, context_lens, query_start_loc, num_tokens,
                        block_size, host_metadata, window)
    num_seqs, max_blocks = shape.num_seqs, shape.max_blocks
    decode_span, max_q_len = shape.decode_span, shape.max_q_len
    if max_q_len > 1 and head_dim > PREFILL_MMA_MAX_HEAD_DIM:
        raise ValueError(f"int4 prefill on CUDA compiles for head_dim up to "
                         f"{PREFILL_MMA_MAX_HEAD_DIM}, got {head_dim}")
    xp = backend.xp
    out = xp.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)  # (T, H, D)
    if num_tokens == 0 or num_seqs == 0:
        return out, []
    metadata = upload_seq_metadata(xp, block_tables, context_lens, query_start_loc, num_seqs)
    window_slot = xp.asarray(window_slot)
    cache = (k_cache, v_cache, k_window, v_window, window_slot)
    unit_scales = (np.float32(scale), np.float32(1.0), np.float32(1.0))
    shift = block_size.bit_length() - 1
    launches: list[Launch] = []
    if decode_span > 0:
        span_blocks = -(-decode_span // block_size) + (1 if window else 0)
        smem = int4_decode_smem_bytes(head_dim, group)
        parts = split_grid(span_blocks, block_size, partition_tokens)  # as the 16-bit planner
        stats_shape = (num_seqs, num_heads, parts) if parts > 1 else (1,)
        tmp_out = xp.empty((*stats_shape, head_dim), np.float32)  # (S, H, P, D) partials
        max_logits = xp.empty(stats_shape, np.float32)  # (S, H, P)
        exp_sums = xp.empty(stats_shape, np.float32)
        decode_ints = (num_heads, num_kv_heads, shift, max_blocks, parts, partition_tokens,
                       window)
        launches.append(Launch(
            backend.function("paged_attention_decode_tc.cu", "paged_attention_decode_tc",
                             int4_defines(head_dim, suffix, group, gqa)),
            (num_kv_heads, num_seqs, parts), (DECODE_TC_THREADS,),
            (out, tmp_out, max_logits, exp_sums, query, *cache, *metadata,
             *(np.int32(v) for v in decode_ints), *unit_scales), smem))
        if parts > 1:  # the 16-bit cache's reduce: it reads only the partials
            launches.append(reduce_launch(backend, decode_defines(head_dim, gqa, suffix, suffix),
                                          out, (tmp_out, max_logits, exp_sums), metadata,
                                          block_size, window, partition_tokens))
    if max_q_len > 1:
        ints = (num_heads, num_kv_heads, shift, max_blocks, window)
        launches.append(Launch(
            backend.function("paged_attention_prefill_mma.cu", "paged_attention_prefill_mma",
                             int4_defines(head_dim, suffix, group, None)),
            (num_kv_heads, num_seqs, -(-max_q_len // (PREFILL_MMA_ROWS // gqa))),
            (PREFILL_MMA_THREADS,),
            (out, query, *cache, *metadata, *(np.int32(v) for v in ints), *unit_scales),
            int4_tiles_bytes(head_dim, group)))
    return out, launches

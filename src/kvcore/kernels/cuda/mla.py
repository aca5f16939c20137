"""Planning of the MLA attention launches (mla_attention.cu): checks, grids, partitions, shared
memory. One kernel serves the decode rows and the prefill chunks of the absorbed form; long
decode contexts are split into partitions and merged by mla_reduce."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.kernels.cuda.launch import (
    Backend,
    Launch,
    cache_suffix_of,
    check_contiguous,
    check_seq_metadata,
    suffix_of,
    upload_seq_metadata,
)
from kvcore.kernels.cuda.occupancy import MAX_PARTITIONS, blocks_per_sm, decode_partitions

SM80_SMEM_OPT_IN = 163 * 1024  # the most dynamic shared memory a block may opt in to
SM90_SMEM_OPT_IN = 227 * 1024

_CTYPES = {"f16": "__half", "bf16": "__nv_bfloat16", "fp8": "__nv_fp8_e4m3"}
MLA_THREADS = 256
MLA_ROWS = 64  # (position, head) query rows per block
MLA_WIDTH_LIMIT = 1024  # kv_lora_rank + rope dim the kernel's tiles are written for
# registers per thread of mla_paged_attention (ptxas: 237-254 at 512 + 64 on sm_80 / sm_90, the
# fp8 cache's fragment conversions the most): 1 block of 8 warps per SM, as shared memory allows;
# the planner reads it, a compile test bounds it
MLA_REGISTERS = 255


def mla_defines(kv_lora_rank: int, rope_dim: int, suffix: str, cache_suffix: str,
                keys: int) -> tuple[str, ...]:
    """The -D options selecting the MLA kernel's compiled variant (`keys` per staged tile)."""
    return (f"KVC_LORA_RANK={kv_lora_rank}", f"KVC_ROPE_DIM={rope_dim}",
            f"KVC_SCALAR={_CTYPES[suffix]}", f"KVC_CACHE={_CTYPES[cache_suffix]}",
            f"KVC_MLA_KEYS={keys}")


def _smem(width: int, cache_itemsize: int, keys: int) -> int:
    # rows padded by 16 bytes; Q and the tiles swizzled instead (no padding) for 64-key tiles
    # of a 16-bit cache with rows of whole 128-byte groups (SmemRows)
    pad = 0 if keys == 64 and cache_itemsize == 2 and width % 64 == 0 else 16
    return (MLA_ROWS * (2 * width + pad) + 2 * keys * (cache_itemsize * width + pad)
            + MLA_ROWS * (2 * keys + 16) + 3 * MLA_ROWS * 4)


def mla_key_tile(width: int, cache_itemsize: int = 2, smem_opt_in: int = SM90_SMEM_OPT_IN
                 ) -> int:
    """Keys per staged tile: 64 where two buffers of them fit the device's opt-in shared memory
    (sm_90 at DeepSeek's 576, fp8 also on sm_80), else 32; 16 for rows wider than 576."""
    if width > 576:
        return 16
    return 64 if _smem(width, cache_itemsize, 64) <= smem_opt_in else 32


def mla_smem_bytes(kv_lora_rank: int, rope_dim: int, cache_itemsize: int = 2,
                   keys: int | None = None) -> int:
    """mla_attention.cu's kSmemBytes: the Q rows (16-bit), two buffers of raw cache tiles,
    P (16-bit), and 3 fp32 row statistics; `keys` per tile (default: mla_key_tile's on sm_90)."""
    width = kv_lora_rank + rope_dim
    return _smem(width, cache_itemsize, keys or mla_key_tile(width, cache_itemsize))


def mla_blocks_per_sm(kv_lora_rank: int, rope_dim: int, cache_itemsize: int, keys: int) -> int:
    """Resident MLA blocks per SM (sm_90) from the kernel's registers and kSmemBytes."""
    return blocks_per_sm(MLA_THREADS, MLA_REGISTERS,
                         mla_smem_bytes(kv_lora_rank, rope_dim, cache_itemsize, keys))


def plan_mla_attention(backend: Backend, query: Any, cache: Any, block_tables: Any,
                       context_lens: Any, query_start_loc: Any, kv_lora_rank: int, scale: float,
                       kv_scale: float = 1.0, *, num_partitions: int | None = None,
                       host_metadata: bool | None = None) -> tuple[Any, list[Launch]]:
    """Check the arguments and prepare the launches; returns (out (T, H, kv_lora_rank),
    launches). query (T, H, W) holds [q_nope W_UK, q_rope] per head, cache (num_blocks,
    block_size, 1, W) the latent and rope key of each token (W = kv_lora_rank + rope dim).

    Host (NumPy) metadata: the grids fit the batch and the values are checked. Device metadata:
    nothing is read back, the grids come from the shapes (blocks skip what they do not own).
    """
    if query.ndim != 3 or cache.ndim != 4 or cache.shape[2] != 1:
        raise ValueError(f"query {query.shape} must be (T, H, W) and cache {cache.shape} "
                         "(num_blocks, block_size, 1, W)")
    num_tokens, num_heads, width = query.shape
    _, block_size, _, cache_width = cache.shape
    rope_dim = width - kv_lora_rank
    if cache_width != width:
        raise ValueError(f"query width {width} != cache width {cache_width}")
    if kv_lora_rank < 16 or kv_lora_rank % 16 or rope_dim < 16 or rope_dim % 16 or \
            width > MLA_WIDTH_LIMIT:
        raise ValueError(f"kv_lora_rank ({kv_lora_rank}) and the rope dim ({rope_dim}) must be "
                         f"positive multiples of 16 with a sum <= {MLA_WIDTH_LIMIT}")
    if num_partitions is not None and not 1 <= num_partitions <= MAX_PARTITIONS:
        raise ValueError(f"num_partitions must be in [1, {MAX_PARTITIONS}], got "
                         f"{num_partitions}")
    for name, value in (("scale", scale), ("kv_scale", kv_scale)):
        if not np.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    suffix = suffix_of("query", query)
    if suffix == "f32":
        raise ValueError("query must be float16 or bfloat16 (the MLA kernel runs on tensor "
                         "cores), got float32")
    cache_suffix = cache_suffix_of("cache", cache, suffix)
    check_contiguous("query", query)
    check_contiguous("cache", cache)
    num_seqs, max_blocks, host_lens = check_seq_metadata(
        backend, block_tables, context_lens, query_start_loc, num_tokens, block_size,
        host_metadata)
    if host_lens is not None:
        q_lens, ctx = host_lens
        num_decode: int | None = int(np.count_nonzero(q_lens == 1))
        decode_span = int(ctx[q_lens == 1].max(initial=0))
        max_q_len = int(q_lens.max(initial=0))
    else:  # bounds from the shapes: every other sequence holds at least one of the T tokens
        num_decode = None
        decode_span = max_blocks * block_size
        max_q_len = num_tokens - num_seqs + 1
    xp = backend.xp
    out = xp.empty((num_tokens, num_heads, kv_lora_rank), dtype=query.dtype)  # (T, H, r)
    if num_tokens == 0 or num_seqs == 0:
        return out, []
    block_tables, context_lens, query_start_loc = upload_seq_metadata(
        xp, block_tables, context_lens, query_start_loc, num_seqs)
    head_tiles = -(-num_heads // MLA_ROWS)
    itemsize = cache.dtype.itemsize
    keys = mla_key_tile(width, itemsize, getattr(backend, "smem_opt_in", SM80_SMEM_OPT_IN))
    if num_partitions is not None:
        parts = num_partitions
    elif decode_span > 0 and num_decode != 0:
        resident = max(1, mla_blocks_per_sm(kv_lora_rank, rope_dim, itemsize, keys))
        parts = decode_partitions((num_decode or num_seqs) * head_tiles,
                                  -(-decode_span // block_size), block_size, backend.num_sms,
                                  resident)
    else:
        parts = 1
    stats_shape = (num_seqs, num_heads, parts) if parts > 1 else (1,)
    tmp_out = xp.empty((*stats_shape, kv_lora_rank), np.float32)  # (S, H, P, r) partials
    max_logits = xp.empty(stats_shape, np.float32)  # (S, H, P)
    exp_sums = xp.empty(stats_shape, np.float32)
    defines = mla_defines(kv_lora_rank, rope_dim, suffix, cache_suffix, keys)
    # power-of-two block sizes: the kernel reads the block table with shifts (-1: division)
    shift = block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else -1
    ints = (num_heads, block_size, shift, max_blocks, parts)
    launches = [Launch(
        backend.function("mla_attention.cu", "mla_paged_attention", defines),
        (-(-max_q_len * num_heads // MLA_ROWS), num_seqs, parts), (MLA_THREADS,),
        (out, query, cache, block_tables, context_lens, query_start_loc, tmp_out, max_logits,
         exp_sums, *(np.int32(v) for v in ints), np.float32(scale), np.float32(kv_scale)),
        mla_smem_bytes(kv_lora_rank, rope_dim, itemsize, keys))]
    if parts > 1:
        launches.append(Launch(
            backend.function("mla_attention.cu", "mla_reduce", defines),
            (num_heads, num_seqs), (128,),
            (out, tmp_out, max_logits, exp_sums, query_start_loc, np.int32(num_heads),
             np.int32(parts)),
            4 * (parts + 1)))
    return out, launches


def mla_tile_traffic(kv_lora_rank: int, rope_dim: int, cache_itemsize: int = 2,
                     keys: int | None = None) -> tuple[int, int, int]:
    """The traffic model of one key tile of one 64-row block: (global bytes, shared-memory
    bytes, FLOPs). Shared: the tile in by cp.async; Q and K fragments of S (each of the 8 warps
    reads its row block's Q and its key half of K); P written once and read by every warp; V
    (the tile's latent columns) read once; the row maxima, rescale factors and their reads."""
    width = kv_lora_rank + rope_dim
    keys = keys or mla_key_tile(width, cache_itemsize)
    rows, warps = MLA_ROWS, MLA_THREADS // 32
    tile = keys * width * cache_itemsize
    fragments = warps * 16 * width * 2 + warps * keys // 2 * width * cache_itemsize
    softmax = rows * keys * 2 * (1 + warps) + (3 * 2 + 8) * 4 * MLA_THREADS
    values = keys * kv_lora_rank * cache_itemsize
    return tile, tile + fragments + softmax + values, 2 * rows * keys * (width + kv_lora_rank)

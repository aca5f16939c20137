"""Occupancy of the attention kernels on an sm_90 GPU: resident blocks per SM from a kernel's
threads, registers and shared memory; split-KV partitions of the GQA decode kernels (fixed by
each sequence's own span, split_kv_reduce.cuh's kv_split) and of MLA (sized to whole waves)."""

from __future__ import annotations

MAX_PARTITIONS = 32  # cap of the split-KV partitions per sequence (and of the scratch width)
# GQA decode: a partition is at least this many tokens (KV blocks rounded up), a constant of the
# planner, never of the batch: a sequence's partitions, and so its output bits, are its own
PARTITION_TOKENS = 512
MIN_PARTITION_TOKENS = 256  # a partition shorter than this costs more to merge than it saves
BLOCKS_PER_SM = 4  # 4-warp decode blocks wanted per SM for one full wave
SM_REGISTERS = 65536  # per SM (sm_80, sm_90)
SM_SMEM_BYTES = 228 * 1024  # per SM on an H100 / H200; each resident block also reserves 1 KiB
SM_THREADS = 2048
SM_BLOCKS = 32


def blocks_per_sm(threads: int, registers: int, smem_bytes: int) -> int:
    """Resident blocks per SM (sm_90) of a kernel of `threads` threads, `registers` per thread
    and `smem_bytes` of shared memory: the least of the thread, block, register (allocated per
    warp in units of 256) and shared-memory (+1 KiB reserved per block) limits."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    by_smem = SM_SMEM_BYTES // (smem_bytes + 1024)
    return min(SM_THREADS // (32 * warps), SM_BLOCKS, SM_REGISTERS // (per_warp * warps), by_smem)


def split_partitions(span_blocks: int, block_size: int,
                     partition_tokens: int = PARTITION_TOKENS) -> int:
    """Split-KV partitions of a sequence whose decode span is `span_blocks` KV blocks (kv_split
    in split_kv_reduce.cuh): runs of max(ceil(partition_tokens / block_size), ceil(span / 32))
    blocks."""
    if span_blocks < 1:
        return 1
    per = max(-(-partition_tokens // block_size), -(-span_blocks // MAX_PARTITIONS))
    return -(-span_blocks // per)


def split_grid(max_span_blocks: int, block_size: int,
               partition_tokens: int = PARTITION_TOKENS) -> int:
    """The grid's partitions for decode spans of up to `max_span_blocks` blocks: the most any
    such sequence takes (split_partitions grows with the span up to MAX_PARTITIONS)."""
    per = -(-partition_tokens // block_size)
    return max(1, min(MAX_PARTITIONS, -(-max_span_blocks // per)))


def decode_partitions(units: int, max_span_blocks: int, block_size: int, num_sms: int,
                      resident: int = BLOCKS_PER_SM) -> int:
    """MLA's split-KV partitions per sequence, sized to whole waves: of 1 .. the useful count (never
    partitions under MIN_PARTITION_TOKENS, at most MAX_PARTITIONS, the cap a CUDA graph sized
    from max_model_len keeps), all of them when they fit one wave, else the fewest whose time,
    waves x tokens per partition, is within 10% of the best (merging costs too); a wave is
    `resident` blocks per SM x num_sms, a partition `units` blocks (decode sequences x KV
    heads)."""
    if units < 1 or num_sms < 1 or resident < 1:
        raise ValueError(f"units, num_sms and resident must be >= 1, got {units}, {num_sms} "
                         f"and {resident}")
    slots = resident * num_sms
    useful = max(1, min(MAX_PARTITIONS, (max_span_blocks * block_size) // MIN_PARTITION_TOKENS))
    if units * useful <= slots:  # all partitions fit one wave: the most, the shortest
        return useful
    times = [-(-units * parts // slots) / parts for parts in range(1, useful + 1)]
    best = min(times)
    return next(parts for parts, t in enumerate(times, 1) if t <= 1.1 * best)

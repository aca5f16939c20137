"""Occupancy of the attention kernels on an sm_90 GPU: resident blocks per SM from a kernel's
threads, registers and shared memory, and split-KV partitions sized to whole waves."""

from __future__ import annotations

MAX_PARTITIONS = 32  # cap of the split-KV partitions per sequence (and of the scratch width)
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


def decode_partitions(units: int, max_span_blocks: int, block_size: int, num_sms: int,
                      resident: int = BLOCKS_PER_SM) -> int:
    """Split-KV partitions per sequence, sized to whole waves: of 1 .. the useful count (never
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

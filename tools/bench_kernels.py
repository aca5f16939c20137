"""Decode paged attention on a GPU: achieved K/V bandwidth against device-to-device copies.

Batch {1, 16, 64, 256} x context {512, 4096, 16384}, GQA 8:1 (32 query / 4 KV heads), head_dim
128, fp16 and fp8 caches, block size 16, blocks of each sequence scattered over the pool.
Bandwidth = K/V bytes the kernel must read / median kernel time (CUDA events); the reference
line is a device-to-device copy measured in the same run (bytes read + written / time, i.e. the
copy engine's useful traffic). At batch 1 it also times
torch.nn.functional.scaled_dot_product_attention on contiguous K/V when torch sees the GPU.
Prints a markdown table; exits 2 at once without a GPU.

    python tools/bench_kernels.py [--quick] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvcore.device import cuda_available  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)


def time_ms(cp: Any, fn: Any, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn() between CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def copy_bandwidth(cp: Any, iters: int) -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = cp.ones(1 << 30, dtype=cp.uint16)
    dst = cp.empty_like(src)
    ms = time_ms(cp, lambda: dst.data.copy_from_device_async(src.data, src.nbytes), iters)
    return 2 * src.nbytes / ms / 1e6


def attention_case(cp: Any, batch: int, context: int, fp8: bool, iters: int
                   ) -> tuple[float, float]:
    """(ms, GB/s) of one decode step over `batch` sequences of `context` tokens."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda_attention import plan_paged_attention

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if fp8:  # small positive e4m3 codes, never NaN
        k_cache = cp.random.randint(0, 0x60, size=shape, dtype=cp.uint8)
        v_cache = cp.random.randint(0, 0x60, size=shape, dtype=cp.uint8)
    else:
        k_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
        v_cache = cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_blocks).reshape(batch, blocks_per_seq).astype(np.int32)
    query = cp.random.standard_normal((batch, NUM_HEADS, HEAD_DIM),
                                      dtype=cp.float32).astype(cp.float16)
    context_lens = np.full(batch, context, dtype=np.int32)
    qsl = np.arange(batch + 1, dtype=np.int32)
    _, launches = plan_paged_attention(cuda.ops().backend, query, k_cache, v_cache, tables,
                                       context_lens, qsl, HEAD_DIM ** -0.5)

    def step() -> None:
        for launch in launches:
            launch()

    ms = time_ms(cp, step, iters)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.dtype.itemsize
    del k_cache, v_cache
    return ms, kv_bytes / ms / 1e6


def sdpa_ms(context: int, iters: int) -> float | None:
    """torch SDPA of one query token over contiguous fp16 K/V (GQA expanded), or None."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda")
    q = torch.randn(1, NUM_HEADS, 1, HEAD_DIM, device=dev, dtype=torch.float16)
    k = torch.randn(1, NUM_KV_HEADS, context, HEAD_DIM, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64, context 4096 only")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("bench_kernels: no CUDA GPU available (cupy finds no device); nothing measured",
              file=sys.stderr)
        return 2
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    copy_gbs = copy_bandwidth(cp, args.iters)
    print(f"device: {props['name'].decode()}; device-to-device copy: {copy_gbs:.0f} GB/s "
          "(read + write)\n")
    batches = (1, 64) if args.quick else BATCHES
    contexts = (4096,) if args.quick else CONTEXTS
    print("| cache | batch | context | time (us) | K/V GB/s | % of copy | SDPA fp16 (us) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    fp16_at: dict[tuple[int, int], float] = {}
    for fp8 in (False, True):
        for batch in batches:
            for context in contexts:
                ms, gbs = attention_case(cp, batch, context, fp8, args.iters)
                if not fp8:
                    fp16_at[batch, context] = ms
                sdpa = sdpa_ms(context, args.iters) if batch == 1 and not fp8 else None
                speedup = "" if not fp8 else f" ({fp16_at[batch, context] / ms:.2f}x fp16)"
                print(f"| {'fp8' if fp8 else 'fp16'} | {batch} | {context} | {ms * 1e3:.1f}"
                      f"{speedup} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | "
                      f"{'' if sdpa is None else f'{sdpa * 1e3:.1f}'} |", flush=True)
                cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

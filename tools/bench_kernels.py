"""Paged attention on a GPU against the hardware: decode bandwidth vs copy, prefill vs SDPA.

Decode: batch {1, 16, 64, 256} x context {512, 4096, 16384}, GQA 8 (32 query / 4 KV heads),
head_dim 128, fp16 and fp8 caches, block size 16, each sequence's blocks scattered over the pool.
Bandwidth = K/V bytes the kernel must read / median kernel time (CUDA events); the reference line
is a device-to-device copy measured in the same run (bytes read + written / time).
Prefill: one causal prompt of {1024, 4096, 16384} tokens (fp16, same heads), TFLOP/s counted as
2 * H * D * L^2 (QK^T and PV, halved by the causal mask), beside
torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on contiguous
K/V when torch sees the GPU.
Before a kernel is timed, its output is checked against a float64 NumPy oracle (two sequences of
every decode batch, the first and last rows of every prompt): a wrong kernel exits 1 unmeasured.
Prints markdown tables; exits 2 at once without a GPU.

    python tools/bench_kernels.py [--quick] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvcore.device import cuda_available  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 16384)
PROMPTS = (1024, 4096, 16384)
FP8_SCALE = 0.05  # k_scale = v_scale for fp8 caches
TOL = 3e-3  # fp16 outputs (the tensor-core prefill rounds P to fp16)


class WrongOutput(Exception):
    """A kernel disagrees with the oracle: nothing is timed."""


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


def random_cache(cp: Any, shape: tuple[int, ...], fp8: bool) -> Any:
    """A random cache on the device: fp16 normals, or fp8 e4m3 codes of magnitude
    < 2^(0x58 >> 3 - 7) = 16 with random sign, never NaN."""
    if fp8:
        return cp.random.randint(0, 0x58, size=shape, dtype=cp.uint8) | \
            (cp.random.randint(0, 2, size=shape, dtype=cp.uint8) << 7)
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(cp.float16)


def shuffled_tables(blocks: list[int], seed: int) -> np.ndarray:
    """(S, max_blocks) int32 block tables over sum(blocks) blocks in a random order."""
    ids = np.random.default_rng(seed).permutation(sum(blocks))
    tables = np.zeros((len(blocks), max(blocks)), dtype=np.int32)  # (S, max_blocks)
    start = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = ids[start:start + n]
        start += n
    return tables


def paged_inputs(cp: Any, context_lens: list[int], q_lens: list[int], fp8: bool,
                 seed: int = 0) -> dict:
    """Random queries and a paged cache (blocks shuffled) in the engine's device layout."""
    blocks = [-(-c // BLOCK_SIZE) for c in context_lens]
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = random_cache(cp, shape, fp8), random_cache(cp, shape, fp8)
    tables = shuffled_tables(blocks, seed)
    query = cp.random.standard_normal((sum(q_lens), NUM_HEADS, HEAD_DIM),
                                      dtype=cp.float32).astype(cp.float16)  # (T, H, D)
    scale = FP8_SCALE if fp8 else 1.0
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=np.array(context_lens, dtype=np.int32),
                query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                scale=HEAD_DIM ** -0.5, k_scale=scale, v_scale=scale)


def _host_rows(cp: Any, cache: Any, table: np.ndarray, ctx: int, scale: float) -> np.ndarray:
    """One sequence's cached rows (ctx, Hkv, D) as float64, dequantized."""
    blocks = cp.asnumpy(cache[cp.asarray(table[:-(-ctx // BLOCK_SIZE)])])
    if blocks.dtype == np.uint8:
        blocks = blocks.view(ml_dtypes.float8_e4m3fn)
    rows = blocks.astype(np.float64).reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:ctx]
    return rows * scale


def check(cp: Any, name: str, out: Any, p: dict, seq: int, rows: np.ndarray) -> None:
    """Query rows `rows` (indices within sequence `seq`'s chunk) against the float64 oracle."""
    ctx = int(p["context_lens"][seq])
    q_start = int(p["query_start_loc"][seq])
    q_len = int(p["query_start_loc"][seq + 1]) - q_start
    keys = _host_rows(cp, p["k_cache"], p["block_tables"][seq], ctx, p["k_scale"])
    values = _host_rows(cp, p["v_cache"], p["block_tables"][seq], ctx, p["v_scale"])
    got = cp.asnumpy(out[q_start + rows]).astype(np.float64)  # (n, H, D)
    query = cp.asnumpy(p["query"][q_start + rows]).astype(np.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    for n, i in enumerate(rows.tolist()):
        pos = ctx - q_len + i  # the row sees keys 0..pos
        k = np.repeat(keys[:pos + 1], group, axis=1)  # (pos + 1, H, D)
        v = np.repeat(values[:pos + 1], group, axis=1)
        scores = np.einsum("hd,khd->hk", query[n], k) * p["scale"]
        w = np.exp(scores - scores.max(axis=1, keepdims=True))
        want = np.einsum("hk,khd->hd", w, v) / w.sum(axis=1)[:, None]
        err = np.abs(got[n] - want).max()
        if not np.isfinite(err) or err > TOL * (1 + np.abs(want).max()):
            raise WrongOutput(f"{name}: sequence {seq} row {i} differs from the float64 oracle "
                              f"by {err:.3g}")


def decode_case(cp: Any, batch: int, context: int, fp8: bool, iters: int
                ) -> tuple[float, float]:
    """(ms, GB/s) of one validated decode step over `batch` sequences of `context` tokens."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.attention import plan_paged_attention

    p = paged_inputs(cp, [context] * batch, [1] * batch, fp8)
    out, launches = plan_paged_attention(cuda.ops().backend, **p)

    def step() -> None:
        for launch in launches:
            launch()

    step()
    for seq in sorted({0, batch - 1}):
        check(cp, f"decode batch {batch} x {context}", out, p, seq, np.array([0]))
    ms = time_ms(cp, step, iters)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * p["k_cache"].dtype.itemsize
    return ms, kv_bytes / ms / 1e6


def prefill_case(cp: Any, length: int, iters: int) -> float:
    """ms of one validated causal fp16 prefill of `length` tokens."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.attention import plan_paged_attention

    p = paged_inputs(cp, [length], [length], fp8=False)
    out, launches = plan_paged_attention(cuda.ops().backend, **p)

    def step() -> None:
        for launch in launches:
            launch()

    step()
    check(cp, f"prefill {length}", out, p, 0, np.r_[0:4, length - 4:length])
    return time_ms(cp, step, iters)


def sdpa_prefill_ms(length: int, iters: int) -> float | None:
    """torch SDPA of a causal fp16 prompt on contiguous K/V (GQA 8), or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda")
    q = torch.randn(1, NUM_HEADS, length, HEAD_DIM, device=dev, dtype=torch.float16)
    k = torch.randn(1, NUM_KV_HEADS, length, HEAD_DIM, device=dev, dtype=torch.float16)
    v = torch.randn_like(k)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

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


def causal_tflops(length: int, ms: float) -> float:
    return 2 * NUM_HEADS * HEAD_DIM * length * length / ms / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true",
                        help="decode batch 1 and 64 at 4,096; prefill 4,096 only")
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
    try:
        print("| decode cache | batch | context | time (us) | K/V GB/s | % of copy |")
        print("|---|---:|---:|---:|---:|---:|")
        fp16_at: dict[tuple[int, int], float] = {}
        for fp8 in (False, True):
            for batch in (1, 64) if args.quick else BATCHES:
                for context in (4096,) if args.quick else CONTEXTS:
                    ms, gbs = decode_case(cp, batch, context, fp8, args.iters)
                    if not fp8:
                        fp16_at[batch, context] = ms
                    speedup = f" ({fp16_at[batch, context] / ms:.2f}x fp16)" if fp8 else ""
                    print(f"| {'fp8' if fp8 else 'fp16'} | {batch} | {context} | "
                          f"{ms * 1e3:.1f}{speedup} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |",
                          flush=True)
                    cp.get_default_memory_pool().free_all_blocks()
        print("\n| prefill (causal, fp16) | time (ms) | TFLOP/s | SDPA (ms) | SDPA TFLOP/s | "
              "ours / SDPA |")
        print("|---:|---:|---:|---:|---:|---:|")
        for length in (4096,) if args.quick else PROMPTS:
            ms = prefill_case(cp, length, args.iters)
            sdpa = sdpa_prefill_ms(length, args.iters)
            ref = ("| | |" if sdpa is None else
                   f"{sdpa:.2f} | {causal_tflops(length, sdpa):.0f} | {sdpa / ms:.2f} |")
            print(f"| {length} | {ms:.2f} | {causal_tflops(length, ms):.0f} | {ref}", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    except WrongOutput as exc:
        print(f"bench_kernels: {exc}; not timed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

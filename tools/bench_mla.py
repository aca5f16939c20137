"""The MLA attention kernel (mla_attention.cu) on a GPU against the hardware: decode bandwidth.

DeepSeek's latent shape (kv_lora_rank 512 + qk_rope_head_dim 64, one cached row per token shared
by every head) with V2-Lite's 16 query heads and V2 / V3's 128, batch {1, 16, 64} x context
{512, 4096, 16384}, fp16 and fp8 latent caches, block size 16, blocks scattered over the pool.
Bandwidth = latent bytes the kernel must read / median kernel time (CUDA events), beside a
device-to-device copy measured in the same run (bytes read + written / time); TFLOP/s counts
2 x H x (576 + 512) per cached token (scores and P V). "% of bound": the case's roofline from
the same run's measurements, max(latent bytes / copy rate, FLOP / cuBLAS fp16 GEMM rate),
over its time (docs/gpu-performance.md estimates it for batch 64 x 4k). Before a case is
timed, two of its sequences are checked against a float64 NumPy oracle: a wrong kernel exits
1 unmeasured. Prints a markdown table; exits 2 at once without a GPU.

    python tools/bench_mla.py [--quick] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import (  # noqa: E402
    WrongOutput,
    copy_bandwidth,
    random_cache,
    shuffled_tables,
    time_ms,
)
from kvcore.device import cuda_available  # noqa: E402

RANK, ROPE, BLOCK_SIZE = 512, 64, 16
WIDTH = RANK + ROPE
HEADS = (16, 64, 128)  # DeepSeek-V2-Lite, 64, DeepSeek-V2 / V3
BATCHES = (1, 16, 64)
CONTEXTS = (512, 4096, 16384)
FP8_SCALE = 0.05
TOL = 3e-3  # fp16 outputs (P is rounded to fp16 before P V)


def mla_inputs(cp: Any, heads: int, context_lens: list[int], fp8: bool, seed: int = 0) -> dict:
    """Random absorbed queries and a latent cache (blocks shuffled) in the engine's layout."""
    blocks = [-(-c // BLOCK_SIZE) for c in context_lens]
    cache = random_cache(cp, (sum(blocks), BLOCK_SIZE, 1, WIDTH), fp8)
    tables = shuffled_tables(blocks, seed)
    query = cp.random.standard_normal((len(context_lens), heads, WIDTH),
                                      dtype=cp.float32).astype(cp.float16)  # (S, H, W)
    return dict(query=query, cache=cache, block_tables=tables,
                context_lens=np.array(context_lens, dtype=np.int32),
                query_start_loc=np.arange(len(context_lens) + 1, dtype=np.int32),
                kv_lora_rank=RANK, scale=(128 + ROPE) ** -0.5,
                kv_scale=FP8_SCALE if fp8 else 1.0)


def check(cp: Any, name: str, out: Any, p: dict, seq: int) -> None:
    """One decode sequence's (H, RANK) output against the float64 oracle."""
    ctx = int(p["context_lens"][seq])
    table = cp.asarray(p["block_tables"][seq, :-(-ctx // BLOCK_SIZE)])
    rows = cp.asnumpy(p["cache"][table])
    if rows.dtype == np.uint8:
        rows = rows.view(ml_dtypes.float8_e4m3fn)
    latents = rows.astype(np.float64).reshape(-1, WIDTH)[:ctx] * p["kv_scale"]  # (ctx, W)
    query = cp.asnumpy(p["query"][seq]).astype(np.float64)  # (H, W)
    scores = query @ latents.T * p["scale"]  # (H, ctx)
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = w @ latents[:, :RANK] / w.sum(axis=1)[:, None]  # (H, RANK)
    err = np.abs(cp.asnumpy(out[seq]).astype(np.float64) - want).max()
    if not np.isfinite(err) or err > TOL * (1 + np.abs(want).max()):
        raise WrongOutput(f"{name}: sequence {seq} differs from the float64 oracle by {err:.3g}")


def decode_case(cp: Any, heads: int, batch: int, context: int, fp8: bool,
                iters: int) -> tuple[float, float, float]:
    """(ms, GB/s, TFLOP/s) of one validated MLA decode step."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.mla import plan_mla_attention

    p = mla_inputs(cp, heads, [context] * batch, fp8)
    out, launches = plan_mla_attention(cuda.ops().backend, **p)

    def step() -> None:
        for launch in launches:
            launch()

    step()
    for seq in sorted({0, batch - 1}):
        check(cp, f"H{heads} batch {batch} x {context}", out, p, seq)
    ms = time_ms(cp, step, iters)
    tokens = batch * context
    gbs = tokens * WIDTH * p["cache"].dtype.itemsize / ms / 1e6
    return ms, gbs, tokens * heads * 2 * (WIDTH + RANK) / ms / 1e9


def gemm_tflops(cp: Any, iters: int, n: int = 8192) -> float:
    """TFLOP/s of an n x n x n fp16 matmul (cuBLAS, tensor cores, fp32 accumulation)."""
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    ms = time_ms(cp, lambda: a @ b, iters)
    return 2 * n ** 3 / ms / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="batch 64 at 4,096 only")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("bench_mla: no CUDA GPU available (cupy finds no device); nothing measured",
              file=sys.stderr)
        return 2
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(0)
    copy_gbs = copy_bandwidth(cp, args.iters)
    peak = gemm_tflops(cp, args.iters)
    cp.get_default_memory_pool().free_all_blocks()
    print(f"device: {props['name'].decode()}; device-to-device copy: {copy_gbs:.0f} GB/s "
          f"(read + write); cuBLAS fp16 GEMM 8192^3: {peak:.0f} TFLOP/s\n")
    print("| MLA decode (512 + 64) | heads | batch | context | time (us) | latent GB/s | "
          "% of copy | TFLOP/s | % of bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for fp8 in (False, True):
            for heads in HEADS:
                for batch in (64,) if args.quick else BATCHES:
                    for context in (4096,) if args.quick else CONTEXTS:
                        ms, gbs, tflops = decode_case(cp, heads, batch, context, fp8, args.iters)
                        bound = max(gbs / copy_gbs, tflops / peak)  # bound time / time
                        print(f"| {'fp8' if fp8 else 'fp16'} | {heads} | {batch} | {context} | "
                              f"{ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% | "
                              f"{tflops:.0f} | {100 * bound:.0f}% |", flush=True)
                        cp.get_default_memory_pool().free_all_blocks()
    except WrongOutput as exc:
        print(f"bench_mla: {exc}; not timed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

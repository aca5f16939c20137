"""Quantized linear kernels against NumPy fp32 and against their weight-bytes bound, in one run.

For each of the default model's weight shapes (SmolLM2-135M: q/k/v fused, o, gate/up fused,
down, LM head) and M = 1, 8, 32, 256 activation rows: the median time of x @ W.T in NumPy
float32 and through kvcore.kernels.cpu.quant (int8, q4, q8), as GFLOP/s (a multiply-add counted as
2) and weight bytes/s, and the time divided by the weight-bytes bound (weight bytes / the read
bandwidth measured here, same threads). Distinct matrices of each shape are cycled so that
weights stream from memory, as in a forward pass. Every kernel is checked against the float64
product of its dequantized weights before it is timed.

    flock /tmp/kvcore-bench.lock python tools/bench_quant.py [--rows 1,8,32,256] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from kvcore.kernels.cpu import quant
from kvcore.kernels.cpu.threads import num_threads

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
STREAM_BYTES = 96 << 20  # fp32 bytes of distinct matrices per shape (beyond any cache)


def read_bandwidth(threads: int) -> float:
    """Bytes/s of summing a 512 MiB float32 array (best of 5), over `threads` slices."""
    data = np.ones(128 << 20, np.float32)
    parts = np.array_split(data, threads)
    from kvcore.kernels.cpu.threads import run_parallel

    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run_parallel(lambda p: p.sum(), parts)
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def timed(fn: Callable[[int], object], count: int, repeats: int) -> float:
    """Median seconds per call of fn(i) over `count` distinct operands, `repeats` rounds."""
    fn(0)
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(count):
            fn(i)
        rounds.append((time.perf_counter() - start) / count)
    return statistics.median(rounds)


def check(x: np.ndarray, weight: quant.QuantizedWeight) -> None:
    exact = x.astype(np.float64) @ quant.dequantize(weight).astype(np.float64).T
    got = quant.linear(x, weight)
    err = np.abs(got - exact).max() / np.abs(exact).max()
    if err > 0.05:  # activation rounding only: int8 with a scale per 32 is ~1%
        raise SystemExit(f"{weight.format} {weight.shape}: relative error {err:.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    threads = num_threads()
    rng = np.random.default_rng(0)
    bandwidth = read_bandwidth(threads)
    blas = [(i.get("internal_api"), i.get("architecture"), i.get("num_threads"))
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print(f"isa {quant.ISA}, {threads} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"BLAS {blas}")
    print(f"{'shape':<9}{'M':>5}{'format':>7}{'ms':>9}{'GFLOP/s':>9}{'GB/s':>7}"
          f"{'x bound':>8}{'vs fp32':>8}")
    results: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        count = max(1, STREAM_BYTES // (n * k * 4))
        floats = [rng.standard_normal((n, k), dtype=np.float32) * 0.05 for _ in range(count)]
        formats: dict[str, list[Any]] = {"fp32": floats}
        for fmt in ("int8", "q4", "q8"):
            formats[fmt] = [quant.QUANTIZERS[fmt](w) for w in floats]
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            base = None
            for fmt, weights in formats.items():
                if fmt == "fp32":
                    nbytes = n * k * 4
                    with threadpool_limits(threads, user_api="blas"):
                        seconds = timed(lambda i, x=x, w=weights: x @ w[i].T, count, args.repeats)
                else:
                    check(x, weights[0])
                    nbytes = weights[0].nbytes
                    seconds = timed(lambda i, x=x, w=weights: quant.linear(x, w[i]), count,
                                    args.repeats)
                base = base or seconds
                row = {"shape": name, "n": n, "k": k, "rows": rows, "format": fmt,
                       "ms": seconds * 1e3, "gflops": 2 * rows * n * k / seconds / 1e9,
                       "gbps": nbytes / seconds / 1e9,
                       "x_bound": seconds / (nbytes / bandwidth), "vs_fp32": base / seconds}
                results.append(row)
                print(f"{name:<9}{rows:>5}{fmt:>7}{row['ms']:>9.3f}{row['gflops']:>9.1f}"
                      f"{row['gbps']:>7.1f}{row['x_bound']:>8.2f}{row['vs_fp32']:>8.2f}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": quant.ISA, "threads": threads, "read_bandwidth": bandwidth,
                       "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""The compiled float32 matmul (kvcore.kernels.cpu.matmul: one reduction order per output,
whatever the number of rows) against OpenBLAS's `x @ W.T`, one thread each, on the default
model's shapes, from one row (decode) to prefill sizes (the tied LM head, 49,152 x 576, up to
64 rows: it multiplies decode rows and each prompt's last row, never a whole prefill).
Validates first (the float64 product, and every row equal to its one-row result bit for bit),
then times: thread CPU time, the best of --repeats runs, the two taking turns.

    .venv/bin/python tools/bench_matmul.py [--rows 1,2,8,32,128,512,2048] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads OpenBLAS

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_info, threadpool_limits  # noqa: E402

from kvcore.kernels.cpu import jit as cpu_numba  # noqa: E402
from kvcore.kernels.cpu import matmul as matmul_numba  # noqa: E402

# (out_features, in_features) of the default model: q/k/v fused, gate/up fused, down, o, LM head
SHAPES = ((960, 576), (3072, 576), (576, 1536), (576, 576), (49152, 576))
LM_HEAD_ROWS = 64  # the LM head is timed up to this many rows


def best(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,8,32,128,512,2048")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    blas = [(i.get("internal_api"), i.get("version"), i.get("architecture"))
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print(f"{platform.machine()}, NumPy {np.__version__}, BLAS {blas}, one thread each, "
          f"best of {args.repeats} (thread CPU time)")
    print("| out x in | rows | OpenBLAS ms | GFLOP/s | kvcore ms | GFLOP/s | kvcore / OpenBLAS |")
    print("|---|---|---|---|---|---|---|")
    rows_out = []
    for n, k in SHAPES:
        weight = cpu_numba.aligned(rng.standard_normal((n, k), dtype=np.float32))
        for m in (int(r) for r in args.rows.split(",")):
            if n == SHAPES[-1][0] and m > LM_HEAD_ROWS:
                continue
            x = cpu_numba.aligned(rng.standard_normal((m, k), dtype=np.float32))
            out = np.empty((m, n), np.float32)
            matmul_numba.matmul_rows(x, weight, out, 0, n)
            reference = x.astype(np.float64) @ weight.T.astype(np.float64)
            assert np.allclose(out, reference, rtol=1e-4, atol=1e-3), "the kernel is wrong"
            one = np.empty((1, n), np.float32)
            matmul_numba.matmul_rows(x[m - 1:], weight, one, 0, n)
            assert np.array_equal(one[0], out[m - 1]), "a row depends on the batch"
            with threadpool_limits(1):
                t_blas = best(lambda: x @ weight.T, args.repeats)  # noqa: B023
            t_ours = best(lambda: matmul_numba.matmul_rows(x, weight, out, 0, n),  # noqa: B023
                          args.repeats)
            flop = 2 * m * n * k
            rows_out.append({"out": n, "in": k, "rows": m, "openblas_s": t_blas,
                             "kvcore_s": t_ours})
            print(f"| {n} x {k} | {m} | {t_blas * 1e3:.3f} | {flop / t_blas / 1e9:.0f} | "
                  f"{t_ours * 1e3:.3f} | {flop / t_ours / 1e9:.0f} | {t_ours / t_blas:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()

"""x (M, in) @ weight (out, in).T for a few rows M on the CPU, compiled (numba).

OpenBLAS runs a GEMM of 2-16 rows against a large weight far below its bandwidth bound (on the
2-core x86_64 VM, SkylakeX kernel: the LM head's 49,152 x 576 took 3-5x as long for 5 rows as
its one-row GEMV, the decoder's gate/up 2.5-4x), which made every verify step of speculative
decoding (1 + k rows) cost about two decode steps. This kernel streams the weight once: each
thread takes blocks of output rows, and every weight row, read once into L1, meets all M
input rows. Each output element is one fixed-order dot product whatever M is: a row's result
does not depend on the other rows of the batch.

Only this module and kvcore.kernels.attention_numba import numba; kvcore.kernels.cpu_numba
decides whether numba runs at all.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvcore.kernels.numba_blocks import FASTMATH

OUT_BLOCK = 64  # output rows per parallel work item


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def matmul_into(x: np.ndarray, weight: np.ndarray, out: np.ndarray) -> None:
    """out (M, out) = x (M, in) @ weight (out, in).T, all float32 and C-contiguous."""
    num_rows, dim = x.shape
    num_out = weight.shape[0]
    for b in prange((num_out + OUT_BLOCK - 1) // OUT_BLOCK):
        for o in range(b * OUT_BLOCK, min(num_out, (b + 1) * OUT_BLOCK)):
            for m in range(num_rows):
                total = np.float32(0.0)
                for k in range(dim):
                    total += x[m, k] * weight[o, k]
                out[m, o] = total

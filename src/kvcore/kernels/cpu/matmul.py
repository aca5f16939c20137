"""x (M, K) @ weight (N, K).T in float32 on the CPU, compiled (numba), for every M.

Reduction order (fixed per output element; the invariant every caller relies on): out[m, n]
is 16 lanes, lane l accumulating x[m, c + l] * w[n, c + l] by fused multiply-adds over the
chunks c = 0, 16, 32, ... in order; then the lanes summed by one fixed tree (simd.hsum,
the tree sums16 applies to each of its vectors); then the K % 16 tail added in order (a
multiply and an add each, never fused: this module is compiled without fastmath). The tiles
(4 rows x 4 outputs where there are 4 rows, else 1 row x 16 outputs, else one element) and the
blocks and thread shares only choose which elements share a pass over memory, never the
arithmetic of one element: a row's result does not depend on M, on the other rows, or on how
the outputs are split over threads. OpenBLAS gives no such promise (its GEMV for one row and
its GEMM for more sum in different orders), which is why the CPU forward runs this for every
float32 linear layer.

Blocks: a block of OUT_BLOCK weight rows stays in L2 while the activation rows of a row block
(ROW_BLOCK_BYTES of them) pass it four at a time; within a 4 x 4 tile each loaded chunk of x
serves four weight rows and each chunk of w four activation rows (16 independent FMA chains).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.cpu.simd import LANES, fma, hsum, load, splat, store, sums16

OUT_BLOCK = 32  # weight rows per block (32 x K floats, L2-resident)
ROW_BLOCK_BYTES = 256 << 10  # activation rows per block: about this many bytes of x


@njit(inline="always")
def _tail(xf: np.ndarray, wf: np.ndarray, x_at: int, w_at: int, full: int, dim: int,
          total: float) -> float:
    """total + the products of columns [full, dim) in order (an unfused multiply and add)."""
    for k in range(full, dim):
        total = total + xf[x_at + k] * wf[w_at + k]
    return total


@njit(inline="always")
def _dot(xf: np.ndarray, wf: np.ndarray, x_at: int, w_at: int, full: int,
         dim: int) -> float:
    """One element alone: the tiles' arithmetic for one pair of rows."""
    acc = splat(np.float32(0.0))
    for c in range(0, full, LANES):
        acc = fma(load(xf, x_at + c), load(wf, w_at + c), acc)
    return _tail(xf, wf, x_at, w_at, full, dim, hsum(acc))


@njit(inline="always")
def _tile4x4(xf: np.ndarray, wf: np.ndarray, of: np.ndarray, m: int, n: int, dim: int,
             full: int, num_out: int, sums: np.ndarray) -> None:
    """out[m:m + 4, n:n + 4]: 16 accumulators, then their 16 lane sums in one tree."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = splat(np.float32(0.0))
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
    x0, x1, x2, x3 = m * dim, (m + 1) * dim, (m + 2) * dim, (m + 3) * dim
    w0, w1, w2, w3 = n * dim, (n + 1) * dim, (n + 2) * dim, (n + 3) * dim
    for c in range(0, full, LANES):
        p0, p1, p2, p3 = load(xf, x0 + c), load(xf, x1 + c), load(xf, x2 + c), load(xf, x3 + c)
        w = load(wf, w0 + c)
        a00, a10, a20, a30 = fma(p0, w, a00), fma(p1, w, a10), fma(p2, w, a20), fma(p3, w, a30)
        w = load(wf, w1 + c)
        a01, a11, a21, a31 = fma(p0, w, a01), fma(p1, w, a11), fma(p2, w, a21), fma(p3, w, a31)
        w = load(wf, w2 + c)
        a02, a12, a22, a32 = fma(p0, w, a02), fma(p1, w, a12), fma(p2, w, a22), fma(p3, w, a32)
        w = load(wf, w3 + c)
        a03, a13, a23, a33 = fma(p0, w, a03), fma(p1, w, a13), fma(p2, w, a23), fma(p3, w, a33)
    store(sums, 0, sums16((a00, a01, a02, a03, a10, a11, a12, a13,
                           a20, a21, a22, a23, a30, a31, a32, a33)))
    for i in range(4):
        for j in range(4):
            total = sums[4 * i + j]
            if full < dim:
                total = _tail(xf, wf, (m + i) * dim, (n + j) * dim, full, dim, total)
            of[(m + i) * num_out + n + j] = total


@njit(inline="always")
def _tile6x4(xf: np.ndarray, wf: np.ndarray, of: np.ndarray, m: int, n: int, dim: int,
             full: int, num_out: int, sums: np.ndarray) -> None:
    """out[m:m + 6, n:n + 4]: 24 accumulators; each weight chunk loaded (from L2) serves six
    activation rows (in L1), then the 24 lane sums in two trees."""
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = splat(np.float32(0.0))
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = a00
    a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = a00
    x0, x1, x2 = m * dim, (m + 1) * dim, (m + 2) * dim
    x3, x4, x5 = (m + 3) * dim, (m + 4) * dim, (m + 5) * dim
    w0, w1, w2, w3 = n * dim, (n + 1) * dim, (n + 2) * dim, (n + 3) * dim
    for c in range(0, full, LANES):
        p0, p1, p2 = load(xf, x0 + c), load(xf, x1 + c), load(xf, x2 + c)
        p3, p4, p5 = load(xf, x3 + c), load(xf, x4 + c), load(xf, x5 + c)
        w = load(wf, w0 + c)
        a00, a10, a20, a30 = fma(p0, w, a00), fma(p1, w, a10), fma(p2, w, a20), fma(p3, w, a30)
        a40, a50 = fma(p4, w, a40), fma(p5, w, a50)
        w = load(wf, w1 + c)
        a01, a11, a21, a31 = fma(p0, w, a01), fma(p1, w, a11), fma(p2, w, a21), fma(p3, w, a31)
        a41, a51 = fma(p4, w, a41), fma(p5, w, a51)
        w = load(wf, w2 + c)
        a02, a12, a22, a32 = fma(p0, w, a02), fma(p1, w, a12), fma(p2, w, a22), fma(p3, w, a32)
        a42, a52 = fma(p4, w, a42), fma(p5, w, a52)
        w = load(wf, w3 + c)
        a03, a13, a23, a33 = fma(p0, w, a03), fma(p1, w, a13), fma(p2, w, a23), fma(p3, w, a33)
        a43, a53 = fma(p4, w, a43), fma(p5, w, a53)
    store(sums, 0, sums16((a00, a01, a02, a03, a10, a11, a12, a13,
                           a20, a21, a22, a23, a30, a31, a32, a33)))
    store(sums, LANES, sums16((a40, a41, a42, a43, a50, a51, a52, a53,
                               a00, a00, a00, a00, a00, a00, a00, a00)))
    for i in range(6):
        for j in range(4):
            total = sums[4 * i + j]
            if full < dim:
                total = _tail(xf, wf, (m + i) * dim, (n + j) * dim, full, dim, total)
            of[(m + i) * num_out + n + j] = total


@njit(inline="always")
def _tile1x16(xf: np.ndarray, wf: np.ndarray, of: np.ndarray, m: int, n: int, dim: int,
              full: int, num_out: int, sums: np.ndarray) -> None:
    """out[m, n:n + 16]: one activation row against 16 weight rows (the GEMV's tile)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = splat(np.float32(0.0))
    a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = a0
    x0, w0 = m * dim, n * dim
    for c in range(0, full, LANES):
        p = load(xf, x0 + c)
        at = w0 + c
        a0, a1 = fma(p, load(wf, at), a0), fma(p, load(wf, at + dim), a1)
        a2, a3 = fma(p, load(wf, at + 2 * dim), a2), fma(p, load(wf, at + 3 * dim), a3)
        a4, a5 = fma(p, load(wf, at + 4 * dim), a4), fma(p, load(wf, at + 5 * dim), a5)
        a6, a7 = fma(p, load(wf, at + 6 * dim), a6), fma(p, load(wf, at + 7 * dim), a7)
        a8, a9 = fma(p, load(wf, at + 8 * dim), a8), fma(p, load(wf, at + 9 * dim), a9)
        a10 = fma(p, load(wf, at + 10 * dim), a10)
        a11 = fma(p, load(wf, at + 11 * dim), a11)
        a12 = fma(p, load(wf, at + 12 * dim), a12)
        a13 = fma(p, load(wf, at + 13 * dim), a13)
        a14 = fma(p, load(wf, at + 14 * dim), a14)
        a15 = fma(p, load(wf, at + 15 * dim), a15)
    store(sums, 0, sums16((a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                           a15)))
    for j in range(16):
        total = sums[j]
        if full < dim:
            total = _tail(xf, wf, x0, (n + j) * dim, full, dim, total)
        of[m * num_out + n + j] = total


@njit(nogil=True, cache=True)
def matmul_rows(x: np.ndarray, weight: np.ndarray, out: np.ndarray, n0: int, n1: int) -> None:
    """out[:, n0:n1] = x (M, K) @ weight[n0:n1].T, all float32 and C-contiguous (a thread's
    share of the outputs)."""
    rows, dim = x.shape
    num_out = out.shape[1]
    full = dim - dim % LANES
    xf, wf, of = x.reshape(x.size), weight.reshape(weight.size), out.reshape(out.size)
    sums = np.empty(2 * LANES, np.float32)
    row_block = max(6, ROW_BLOCK_BYTES // (4 * max(dim, 1)) // 6 * 6)
    for r0 in range(0, rows, row_block):
        r1 = min(rows, r0 + row_block)
        for b0 in range(n0, n1, OUT_BLOCK):
            b1 = min(n1, b0 + OUT_BLOCK)
            m = r0
            while m + 6 <= r1:
                n = b0
                while n + 4 <= b1:
                    _tile6x4(xf, wf, of, m, n, dim, full, num_out, sums)
                    n += 4
                for j in range(n, b1):
                    for i in range(m, m + 6):
                        of[i * num_out + j] = _dot(xf, wf, i * dim, j * dim, full, dim)
                m += 6
            while m + 4 <= r1:
                n = b0
                while n + 4 <= b1:
                    _tile4x4(xf, wf, of, m, n, dim, full, num_out, sums)
                    n += 4
                for j in range(n, b1):
                    for i in range(m, m + 4):
                        of[i * num_out + j] = _dot(xf, wf, i * dim, j * dim, full, dim)
                m += 4
            for i in range(m, r1):
                n = b0
                while n + 16 <= b1:
                    _tile1x16(xf, wf, of, i, n, dim, full, num_out, sums)
                    n += 16
                for j in range(n, b1):
                    of[i * num_out + j] = _dot(xf, wf, i * dim, j * dim, full, dim)

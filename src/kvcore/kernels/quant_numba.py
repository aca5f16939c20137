"""Compiled quantized-weight GEMM / GEMV (numba): int8 activations times int8 weights (one scale
per output channel) or block-quantized weights (q4 nibbles or q8 bytes, a scale per 32).

Weights are (rows padded to TILE, K padded to PAD_K) so the loops have no tails. A call covers
the weight rows [n0, n1) (whole tiles): a thread's share. Each tile of TILE weight rows (16 x K
bytes, L1-resident) serves every activation row before the next tile is read, so the weights
stream from memory once whatever M is; within a tile the activation rows go 4 at a time (each
weight step loaded once for 4 dot products) and the remaining 1-3 one at a time. The integer
dot steps are quant_simd's intrinsics; `isa` picks their instruction set.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.quant_simd import BLOCK, dot_blocks, dot_i8, fsum, fzero, isum, izero, step

TILE = 16  # weight rows per tile (and the row padding)
PAD_K = 64  # K is padded to a multiple of this (one VNNI step)


@njit(nogil=True, cache=True)
def quantize_rows(x: np.ndarray, a: np.ndarray, scales: np.ndarray, block_sums: np.ndarray,
                  permute: bool) -> None:
    """x (M, K) float32 -> a (M, Kp) int8 (zero past K), per-row scales (M,) (x ~ a * scale,
    symmetric, round half to even) and the sums of each 32-block of a (M, Kp / 32) as float32.
    permute: store each 64 as [0:16, 32:48, 16:32, 48:64] (the VNNI q4 step's nibble order)."""
    rows, k = x.shape
    kp = a.shape[1]
    for r in range(rows):
        peak = np.float32(0.0)
        for j in range(k):
            peak = max(peak, abs(x[r, j]))
        scale = peak / np.float32(127.0)
        inv = np.float32(1.0) / scale if peak > 0 else np.float32(0.0)
        scales[r] = scale
        for b in range(kp // BLOCK):
            block_sums[r, b] = 0.0
        for j in range(kp):
            value = np.int8(np.rint(x[r, j] * inv)) if j < k else np.int8(0)
            block_sums[r, j // BLOCK] += value
            dest = j
            if permute:
                within = j % 64
                quarter = within // 16
                if quarter == 1 or quarter == 2:
                    dest = j + 16 if quarter == 1 else j - 16
            a[r, dest] = value


@njit(nogil=True, cache=True)
def int8_rows(isa: np.ndarray, a: np.ndarray, a_scales: np.ndarray, w: np.ndarray,
              w_scales: np.ndarray, corrections: np.ndarray, out: np.ndarray,
              n0: int, n1: int) -> None:
    """out[:, n0:n1] = a_scales x w_scales x (a @ w.T - corrections): a (M, Kp) int8, w
    (Np, Kp) int8 flattened, corrections (Np,) int64 (128 x the row sums on VNNI, else 0)."""
    rows, kp = a.shape
    n_out = out.shape[1]
    af = a.reshape(-1)
    width = step(isa)
    for tile in range(n0, n1, TILE):
        r = 0
        while r + 4 <= rows:
            a0, a1, a2, a3 = r * kp, (r + 1) * kp, (r + 2) * kp, (r + 3) * kp
            for n in range(tile, tile + TILE):
                c0, c1, c2, c3 = izero(isa), izero(isa), izero(isa), izero(isa)
                wn = n * kp
                for k in range(0, kp, width):
                    c0 = dot_i8(isa, c0, af, a0 + k, w, wn + k)
                    c1 = dot_i8(isa, c1, af, a1 + k, w, wn + k)
                    c2 = dot_i8(isa, c2, af, a2 + k, w, wn + k)
                    c3 = dot_i8(isa, c3, af, a3 + k, w, wn + k)
                if n < n_out:
                    ws, cn = w_scales[n], corrections[n]
                    out[r, n] = a_scales[r] * ws * np.float32(isum(c0) - cn)
                    out[r + 1, n] = a_scales[r + 1] * ws * np.float32(isum(c1) - cn)
                    out[r + 2, n] = a_scales[r + 2] * ws * np.float32(isum(c2) - cn)
                    out[r + 3, n] = a_scales[r + 3] * ws * np.float32(isum(c3) - cn)
            r += 4
        while r < rows:  # one activation row against 4 weight rows at a time
            ar = r * kp
            for n in range(tile, tile + TILE, 4):
                c0, c1, c2, c3 = izero(isa), izero(isa), izero(isa), izero(isa)
                for k in range(0, kp, width):
                    c0 = dot_i8(isa, c0, af, ar + k, w, n * kp + k)
                    c1 = dot_i8(isa, c1, af, ar + k, w, (n + 1) * kp + k)
                    c2 = dot_i8(isa, c2, af, ar + k, w, (n + 2) * kp + k)
                    c3 = dot_i8(isa, c3, af, ar + k, w, (n + 3) * kp + k)
                sums = (isum(c0), isum(c1), isum(c2), isum(c3))
                for j in range(4):
                    if n + j < n_out:
                        out[r, n + j] = a_scales[r] * w_scales[n + j] * np.float32(
                            sums[j] - corrections[n + j])
            r += 1


@njit(nogil=True, cache=True, fastmath=True)
def _add_mins(out: np.ndarray, a_scales: np.ndarray, block_sums: np.ndarray, mins: np.ndarray,
              n0: int, n1: int) -> None:
    """out[:, n0:n1] += a_scales x (mins @ block_sums.T): q4's per-block offsets."""
    n_end = min(n1, out.shape[1])
    for r in range(out.shape[0]):
        for n in range(n0, n_end):
            total = np.float32(0.0)
            for b in range(block_sums.shape[1]):
                total += mins[n, b] * block_sums[r, b]
            out[r, n] += a_scales[r] * total


@njit(nogil=True, cache=True, fastmath=True)
def block_rows(isa: np.ndarray, a: np.ndarray, a_scales: np.ndarray, block_sums: np.ndarray,
               q: np.ndarray, d: np.ndarray, mins: np.ndarray, has_min: bool,
               corrections: np.ndarray, out: np.ndarray, n0: int, n1: int) -> None:
    """out[:, n0:n1] = a_scales x (sum over blocks of d x (a . q) + mins x block_sums -
    corrections): q the flattened (Np, Kp) weights (uint8 packed nibbles: q4, int8: q8),
    d and mins (Np, Kp / 32) float32, corrections (Np,) float32 (128 x sum(d q) for q8 on
    VNNI, else 0)."""
    rows, kp = a.shape
    n_out = out.shape[1]
    num_blocks = kp // BLOCK
    af, df = a.reshape(-1), d.reshape(-1)
    width = step(isa)
    for tile in range(n0, n1, TILE):
        r = 0
        while r + 4 <= rows:
            a0, a1, a2, a3 = r * kp, (r + 1) * kp, (r + 2) * kp, (r + 3) * kp
            for n in range(tile, tile + TILE):
                f0, f1, f2, f3 = fzero(isa), fzero(isa), fzero(isa), fzero(isa)
                wn, dn = n * kp, n * num_blocks
                for k in range(0, kp, width):
                    db = dn + k // BLOCK
                    f0 = dot_blocks(isa, f0, q, wn + k, af, a0 + k, df, db)
                    f1 = dot_blocks(isa, f1, q, wn + k, af, a1 + k, df, db)
                    f2 = dot_blocks(isa, f2, q, wn + k, af, a2 + k, df, db)
                    f3 = dot_blocks(isa, f3, q, wn + k, af, a3 + k, df, db)
                if n < n_out:
                    cn = corrections[n]
                    out[r, n] = a_scales[r] * (fsum(f0) - cn)
                    out[r + 1, n] = a_scales[r + 1] * (fsum(f1) - cn)
                    out[r + 2, n] = a_scales[r + 2] * (fsum(f2) - cn)
                    out[r + 3, n] = a_scales[r + 3] * (fsum(f3) - cn)
            r += 4
        while r < rows:  # one activation row against 2 weight rows at a time
            ar = r * kp
            for n in range(tile, tile + TILE, 2):
                f0, f1 = fzero(isa), fzero(isa)
                w0, w1 = n * kp, (n + 1) * kp
                for k in range(0, kp, width):
                    f0 = dot_blocks(isa, f0, q, w0 + k, af, ar + k, df,
                                    n * num_blocks + k // BLOCK)
                    f1 = dot_blocks(isa, f1, q, w1 + k, af, ar + k, df,
                                    (n + 1) * num_blocks + k // BLOCK)
                if n < n_out:
                    out[r, n] = a_scales[r] * (fsum(f0) - corrections[n])
                if n + 1 < n_out:
                    out[r, n + 1] = a_scales[r] * (fsum(f1) - corrections[n + 1])
            r += 1
        if has_min:
            _add_mins(out, a_scales, block_sums, mins, tile, tile + TILE)

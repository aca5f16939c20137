"""Compiled quantized-weight GEMM / GEMV (numba): int8 activations (a scale per block of 32)
times quantized weights: q4 nibbles or q8 bytes with a scale per block of 32, or int8 with one
scale per output row (stored twice per row: `d_stride` 2, `d_step` 0, so the same step reads
it).

Weights are (rows padded to TILE, K padded to PAD_K) so the loops have no tails. A call covers
the weight rows [n0, n1) (whole tiles): a thread's share. Each tile of TILE weight rows (16 x K
bytes, L1-resident) serves every activation row before the next tile is read, so the weights
stream from memory once whatever M is; within a tile the activation rows go 4 at a time (each
weight step loaded once for 4 dot products) and the remaining 1-3 one at a time. The integer
dot steps are quant_simd's intrinsics; `isa` picks their instruction set.

Reduction order (fixed per output element; the invariant every caller relies on): out[r, n] is
one accumulator of float lanes taking dot_blocks(step k) for k = 0, width, 2 width, ... in order
(the integer dot of the step's blocks, converted and scaled by weight scale x activation scale),
summed by fsum's lane tree, then (q4's mins, the VNNI offsets) its block terms added in block
order; activations are quantized per row. The 4-row and the 1-row loops run the same steps per
element, so a row's result does not depend on how many rows the call has. Compiled without
fastmath: with it, LLVM's freedom to reassociate let the same source give other bits where the
function was compiled into another one (the fused decode region) or loaded from numba's cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcore.kernels.cpu.quant_layout import BLOCK, TILE
from kvcore.kernels.cpu.quant_simd import dot_blocks, fsum, fzero, step


@njit(nogil=True, cache=True)
def quantize_rows(x: np.ndarray, a: np.ndarray, scales: np.ndarray, block_sums: np.ndarray,
                  permute: bool) -> None:
    """x (M, K) float32 -> a (M, Kp) int8 (zero past K), a scale per block of 32 (M, Kp / 32)
    (x ~ a x scale, symmetric, round half to even) and each block's sum of a x scale (M,
    Kp / 32). permute: store each 64 as [0:16, 32:48, 16:32, 48:64] (the VNNI q4 step's
    nibble order)."""
    rows, k = x.shape
    kp = a.shape[1]
    for r in range(rows):
        for b in range(kp // BLOCK):
            peak = np.float32(0.0)
            for j in range(b * BLOCK, min(k, (b + 1) * BLOCK)):
                peak = max(peak, abs(x[r, j]))
            scale = peak / np.float32(127.0)
            inv = np.float32(1.0) / scale if peak > 0 else np.float32(0.0)
            scales[r, b] = scale
            total = np.int64(0)
            for j in range(b * BLOCK, (b + 1) * BLOCK):
                value = np.int8(np.rint(x[r, j] * inv)) if j < k else np.int8(0)
                total += np.int64(value)
                dest = j
                if permute:
                    quarter = j % 64 // 16
                    if quarter == 1:
                        dest = j + 16
                    elif quarter == 2:
                        dest = j - 16
                a[r, dest] = value
            block_sums[r, b] = total * scale


@njit(nogil=True, cache=True)
def _add_block_terms(out: np.ndarray, terms: np.ndarray, act_terms: np.ndarray,
                     n0: int, n1: int) -> None:
    """out[:, n0:n1] += act_terms @ terms[n0:n1].T: q4's per-block mins, or the VNNI offset's
    corrections, over the blocks."""
    n_end = min(n1, out.shape[1])
    for r in range(out.shape[0]):
        for n in range(n0, n_end):
            total = np.float32(0.0)
            for b in range(act_terms.shape[1]):
                total += terms[n, b] * act_terms[r, b]
            out[r, n] += total


@njit(nogil=True, cache=True)
def block_rows(isa: np.ndarray, a: np.ndarray, a_scales: np.ndarray, q: np.ndarray,
               d: np.ndarray, d_stride: int, d_step: int, terms: np.ndarray,
               act_terms: np.ndarray, has_terms: bool, out: np.ndarray, n0: int,
               n1: int) -> None:
    """out[:, n0:n1] = sum over blocks b of d[n, b] a_scales[r, b] (a[r, b] . q[n, b])
    + act_terms[r] . terms[n] (if has_terms): a (M, Kp) int8, a_scales (M, Kp / 32), q the
    flattened (Np, Kp) weights (uint8 packed nibbles: q4; int8: q8, int8), d flattened with
    block b of row n at n * d_stride + b * d_step."""
    rows, kp = a.shape
    n_out = out.shape[1]
    num_blocks = kp // BLOCK
    af, sf = a.reshape(-1), a_scales.reshape(-1)
    width = step(isa)
    for tile in range(n0, n1, TILE):
        r = 0
        while r + 4 <= rows:
            a0, a1, a2, a3 = r * kp, (r + 1) * kp, (r + 2) * kp, (r + 3) * kp
            s0, s1 = r * num_blocks, (r + 1) * num_blocks
            s2, s3 = (r + 2) * num_blocks, (r + 3) * num_blocks
            for n in range(tile, tile + TILE):
                f0, f1, f2, f3 = fzero(isa), fzero(isa), fzero(isa), fzero(isa)
                wn = n * kp
                for k in range(0, kp, width):
                    b = k // BLOCK
                    db = n * d_stride + b * d_step
                    f0 = dot_blocks(isa, f0, q, wn + k, af, a0 + k, d, db, sf, s0 + b)
                    f1 = dot_blocks(isa, f1, q, wn + k, af, a1 + k, d, db, sf, s1 + b)
                    f2 = dot_blocks(isa, f2, q, wn + k, af, a2 + k, d, db, sf, s2 + b)
                    f3 = dot_blocks(isa, f3, q, wn + k, af, a3 + k, d, db, sf, s3 + b)
                if n < n_out:
                    out[r, n] = fsum(f0)
                    out[r + 1, n] = fsum(f1)
                    out[r + 2, n] = fsum(f2)
                    out[r + 3, n] = fsum(f3)
            r += 4
        while r < rows:  # one activation row against 2 weight rows at a time
            ar, sr = r * kp, r * num_blocks
            for n in range(tile, tile + TILE, 2):
                f0, f1 = fzero(isa), fzero(isa)
                w0, w1 = n * kp, (n + 1) * kp
                for k in range(0, kp, width):
                    b = k // BLOCK
                    f0 = dot_blocks(isa, f0, q, w0 + k, af, ar + k, d,
                                    n * d_stride + b * d_step, sf, sr + b)
                    f1 = dot_blocks(isa, f1, q, w1 + k, af, ar + k, d,
                                    (n + 1) * d_stride + b * d_step, sf, sr + b)
                if n < n_out:
                    out[r, n] = fsum(f0)
                if n + 1 < n_out:
                    out[r, n + 1] = fsum(f1)
            r += 1
        if has_terms:
            _add_block_terms(out, terms, act_terms, tile, tile + TILE)

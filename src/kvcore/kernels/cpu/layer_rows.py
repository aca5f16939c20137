"""RMSNorm, SwiGLU and rotary embedding one row at a time, compiled (numba): what the per-op CPU
path runs when numba imports (kvcore.kernels.cpu's rms_norm / silu_and_mul / rope) and what the
fused decode step (kvcore.kernels.cpu.decode_step) runs inside its region, the same functions,
so a row gets the same bits on either path.

Reduction order (per row, fixed): RMSNorm's sum of squares is 16 lanes of fused multiply-adds
over the chunks of 16 in order, one fixed lane tree (simd.hsum), then the tail in order; then
mean = sum / n + eps, inv = 1 / sqrt(mean), out = x * inv * weight. SwiGLU and rope are
element-wise: silu(g) * u as h = g / 2, (tanh(h) * h + h) * u (no exp overflow); rope as
x1 * cos - x2 * sin and x2 * cos + x1 * sin (HF's rotate-half), each product rounded (compiled
without fastmath: no contraction)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvcore.kernels.cpu.simd import LANES, fma, hsum, load, splat


@njit(nogil=True, inline="always")
def rms_norm_row(x: np.ndarray, x_at: int, weight: np.ndarray, eps: float, out: np.ndarray,
                 out_at: int, n: int) -> None:
    """out[out_at:out_at + n] = rms_norm(x[x_at:x_at + n]) * weight (flat float32 arrays)."""
    full = n - n % LANES
    acc = splat(np.float32(0.0))
    for c in range(0, full, LANES):
        v = load(x, x_at + c)
        acc = fma(v, v, acc)
    total = hsum(acc)
    for j in range(full, n):
        total = total + x[x_at + j] * x[x_at + j]
    mean = total / np.float32(n) + np.float32(eps)
    inv = np.float32(1.0) / np.float32(math.sqrt(mean))
    for j in range(n):
        out[out_at + j] = x[x_at + j] * inv * weight[j]


@njit(nogil=True, inline="always")
def silu_mul_cols(gate_up: np.ndarray, g_at: int, u_at: int, out: np.ndarray, out_at: int,
                  n: int) -> None:
    """out[out_at + j] = silu(gate_up[g_at + j]) * gate_up[u_at + j] for j < n (flat)."""
    for j in range(n):
        h = gate_up[g_at + j] * np.float32(0.5)
        t = np.float32(math.tanh(h))
        out[out_at + j] = (t * h + h) * gate_up[u_at + j]


@njit(nogil=True, inline="always")
def rope_head(x: np.ndarray, x_at: int, cos: np.ndarray, sin: np.ndarray, position: int,
              out: np.ndarray, out_at: int, dim: int) -> None:
    """One head (dim values at x_at) rotated for `position` into out at out_at (flat; x and
    out may be the same array at the same place)."""
    half = dim // 2
    for j in range(half):
        c, s = cos[position, j], sin[position, j]
        x1, x2 = x[x_at + j], x[x_at + half + j]
        out[out_at + j] = x1 * c - x2 * s
        out[out_at + half + j] = x2 * c + x1 * s


@njit(nogil=True, cache=True)
def rms_norm_rows(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray, r0: int,
                  r1: int) -> None:
    """Rows [r0, r1) of x (T, n) -> out (T, n), float32, C-contiguous."""
    n = x.shape[1]
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for r in range(r0, r1):
        rms_norm_row(xf, r * n, weight, eps, of, r * n, n)


@njit(nogil=True, cache=True)
def silu_mul_rows(gate_up: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """Rows [r0, r1) of gate_up (T, 2I) = [gate | up] -> out (T, I)."""
    inter = out.shape[1]
    gf, of = gate_up.reshape(gate_up.size), out.reshape(out.size)
    for r in range(r0, r1):
        silu_mul_cols(gf, 2 * r * inter, (2 * r + 1) * inter, of, r * inter, inter)


@njit(nogil=True, cache=True)
def rope_rows(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
              out: np.ndarray, r0: int, r1: int) -> None:
    """Rows [r0, r1) of x (T, H, D) rotated for positions (T,) -> out (T, H, D)."""
    heads, dim = x.shape[1], x.shape[2]
    xf, of = x.reshape(x.size), out.reshape(out.size)
    for r in range(r0, r1):
        for head in range(heads):
            at = (r * heads + head) * dim
            rope_head(xf, at, cos, sin, positions[r], of, at, dim)

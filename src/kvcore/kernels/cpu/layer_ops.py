"""Element-wise layer ops (RMSNorm, SwiGLU, rotary embedding), array-generic: NumPy or CuPy.

Reduction order (per row, whatever else the call holds): SwiGLU and rope are element-wise;
RMSNorm sums each row's squares in one reduction over its own elements; large inputs are split
into chunks and threads of whole rows. So a row's result does not depend on the batch."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from kvcore.config import RopeScaling
from kvcore.device import array_module
from kvcore.kernels.cpu.threads import run_parallel, split

# NumPy ops this large are split by rows over the kernel threads (a prefill's activations);
# smaller ones cost less than the hand-off
_PARALLEL_MIN_ELEMENTS = 1 << 18
# each thread runs a large op in row chunks of about this many input elements (1 MB): the op's
# few passes (each a ufunc over its input) then stay in the core's cache (SwiGLU over a 2,048-token
# prefill: 1.7x faster than whole-array passes on one thread); much smaller chunks lose more to
# the GIL between ufuncs than they gain once two threads share the work (measured)
_CHUNK_ELEMENTS = 1 << 18


def _by_rows(op: Callable[..., Any], x: Any, out_cols: int, *row_args: Any) -> Any:
    """op(x[rows], *(a[rows] for a in row_args)) for row ranges, in cache-sized chunks and in
    parallel for large NumPy inputs; out (T, *x.shape[1:-1], out_cols) float32."""
    if array_module(x) is not np or x.size < _PARALLEL_MIN_ELEMENTS:
        return op(x, *row_args)
    out = np.empty((*x.shape[:-1], out_cols), dtype=np.float32)
    row_elements = x.size // max(x.shape[0], 1)
    chunk_rows = max(1, _CHUNK_ELEMENTS // row_elements)

    def part(rows: range) -> None:
        for start in range(rows.start, rows.stop, chunk_rows):
            sl = slice(start, min(start + chunk_rows, rows.stop))
            out[sl] = op(x[sl], *(a[sl] for a in row_args))

    run_parallel(part, split(x.shape[0], min_part=max(1, (1 << 16) // row_elements)))
    return out


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """x / rms(x) * weight over the last axis, in float32 (NumPy or CuPy)."""
    return _by_rows(lambda rows: _rms_norm(rows, weight, eps), x, x.shape[-1])


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    xp = array_module(x)
    x = x.astype(np.float32, copy=False)
    # einsum sums the squares without an (T, hidden) temporary
    mean_square = xp.einsum("...i,...i->...", x, x)[..., None]  # (T, 1)
    mean_square /= x.shape[-1]
    mean_square += np.float32(eps)
    out = x * (1.0 / xp.sqrt(mean_square))
    out *= weight
    return out


def silu_and_mul(x: Any) -> Any:
    """x (T, 2I) = [gate | up] -> silu(gate) * up (T, I)."""
    return _by_rows(_silu_and_mul, x, x.shape[-1] // 2)


def _silu_and_mul(x: Any) -> Any:
    xp = array_module(x)
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    # silu(g) = g * sigmoid(g) = h + h * tanh(h) with h = g / 2: no exp overflow, in place
    h = gate * np.float32(0.5)
    out = xp.tanh(h)
    out *= h
    out += h
    out *= up
    return out


def rope_inv_freq(head_dim: int, rope_theta: float,
                  rope_scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies (D/2,) float64, with linear or llama3 scaling as transformers does."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if rope_scaling is None:
        return inv_freq
    factor = rope_scaling.factor
    if rope_scaling.rope_type == "linear":
        return inv_freq / factor
    if rope_scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope_theta, rope_scaling)
    old_len = rope_scaling.original_max_position_embeddings
    low, high = rope_scaling.low_freq_factor, rope_scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: np.ndarray, head_dim: int, rope_theta: float,
                   rope_scaling: RopeScaling) -> np.ndarray:
    """YaRN (as DeepSeek and transformers): frequencies that turn fewer than beta_slow times
    over the original context are interpolated (divided by factor), those that turn more than
    beta_fast times kept, and a linear ramp over the dimensions in between blends the two."""
    old_len = rope_scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope_theta))

    low, high = dim_of(rope_scaling.beta_fast), dim_of(rope_scaling.beta_slow)
    if rope_scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    # float32 like transformers: the ramp decides which frequencies blend
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float64)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / rope_scaling.factor * (1 - keep) + inv_freq * keep


def rope_cos_sin(inv_freq: np.ndarray, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables (num_positions, D/2) float32 for positions 0 .. num_positions - 1."""
    angles = np.arange(num_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x: Any, positions: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half (HF layout) rotary embedding: x (T, H, D), positions (T,) -> (T, H, D)."""
    return _by_rows(lambda rows, pos: _rope(rows, pos, cos, sin), x, x.shape[-1], positions)


def _rope(x: Any, positions: Any, cos: Any, sin: Any) -> Any:
    xp = array_module(x)
    half = x.shape[-1] // 2
    c = cos[positions][:, None, :]  # (T, 1, D/2)
    s = sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate((x1 * c - x2 * s, x2 * c + x1 * s), axis=-1)

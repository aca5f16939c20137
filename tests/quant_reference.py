"""The quantized kernels' NumPy reference: activations quantized the same way (per row,
symmetric, round half to even), weights dequantized, then a float64 matmul."""

from __future__ import annotations

import numpy as np

from kvcore.kernels.quant import QuantizedWeight, dequantize


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (M, K) float32 -> (int values as float64 (M, K), per-row scales (M,) float32)."""
    peak = np.abs(x).max(axis=1)
    scales = (peak / np.float32(127.0)).astype(np.float32)
    inv = np.where(peak > 0, np.float32(1.0) / np.where(scales > 0, scales, 1), 0)
    return np.rint(x * inv.astype(np.float32)[:, None]).astype(np.float64), scales


def reference_linear(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """(M, N) float64: what quant.linear computes, in exact arithmetic."""
    values, scales = quantize_activations(x)
    return (values * scales.astype(np.float64)[:, None]) @ dequantize(weight).astype(np.float64).T

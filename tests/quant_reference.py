"""The quantized kernels' NumPy reference: activations quantized the same way (a scale per block
of 32, symmetric, round half to even), weights dequantized, then a float64 matmul."""

from __future__ import annotations

import numpy as np

from kvcore.kernels.cpu.quant import QuantizedWeight, dequantize

BLOCK = 32


def dequantized_activations(x: np.ndarray) -> np.ndarray:
    """x (M, K) float32 -> what the int8 activations with their block scales stand for, float64."""
    rows, k = x.shape
    kp = -(-k // BLOCK) * BLOCK
    blocks = np.zeros((rows, kp), np.float32)
    blocks[:, :k] = x
    blocks = blocks.reshape(rows, kp // BLOCK, BLOCK)
    peak = np.abs(blocks).max(axis=2, keepdims=True)
    scales = (peak / np.float32(127.0)).astype(np.float32)
    inv = np.where(peak > 0, np.float32(1.0) / np.where(scales > 0, scales, 1), 0)
    values = np.rint(blocks * inv.astype(np.float32))
    return (values.astype(np.float64) * scales.astype(np.float64)).reshape(rows, kp)[:, :k]


def reference_linear(x: np.ndarray, weight: QuantizedWeight) -> np.ndarray:
    """(M, N) float64: what quant.linear computes, in exact arithmetic."""
    return dequantized_activations(x) @ dequantize(weight).astype(np.float64).T

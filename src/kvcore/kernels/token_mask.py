"""Applying packed token bitmasks to logits in place: logits[row, t] = -inf where bit t of the
row's mask is 0 (bit t % 32 of int32 word t // 32, llguidance's layout). A numba loop on NumPy
arrays, array ops on CuPy arrays (the NumPy form of those ops is the reference)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kvcore.device import array_module


def apply_token_bitmask(logits: Any, rows: Any, masks: Any) -> None:
    """`logits` (B, V) float32, `rows` (C,) int64 row of each mask, `masks` (C, W) int32 with
    W >= ceil(V / 32), all on one device; logits of masked-out tokens become -inf."""
    xp = array_module(logits)
    if (logits.ndim != 2 or logits.dtype != xp.float32 or rows.ndim != 1 or masks.ndim != 2
            or masks.dtype != xp.int32 or masks.shape[0] != rows.shape[0]
            or masks.shape[1] * 32 < logits.shape[1]):
        raise ValueError(f"apply_token_bitmask: logits (B, V) float32, rows (C,), masks (C, W) "
                         f"int32 with 32 W >= V; got {logits.dtype} {logits.shape}, "
                         f"{rows.shape}, {masks.dtype} {masks.shape}")
    if xp is np:
        if not logits.flags.c_contiguous:
            raise ValueError("apply_token_bitmask: logits must be C-contiguous")
        _apply_numba(logits, np.ascontiguousarray(rows, dtype=np.int64),
                     np.ascontiguousarray(masks))
    else:
        apply_token_bitmask_xp(logits, rows, masks)


def apply_token_bitmask_xp(logits: Any, rows: Any, masks: Any) -> None:
    """The same with array ops (CuPy, and the NumPy reference)."""
    xp = array_module(logits)
    vocab_size = logits.shape[1]
    tokens = xp.arange(vocab_size)  # (V,)
    words = masks[:, tokens >> 5]  # (C, V) int32
    allowed = ((words >> (tokens & 31).astype(xp.int32)) & 1).astype(bool)
    logits[rows] = xp.where(allowed, logits[rows], xp.float32(-xp.inf))


@numba.njit(cache=True, nogil=True)
def _apply_numba(logits: np.ndarray, rows: np.ndarray, masks: np.ndarray) -> None:
    vocab_size = logits.shape[1]
    neg_inf = np.float32(-np.inf)
    for c in range(rows.shape[0]):
        row = logits[rows[c]]
        mask = masks[c]
        for w in range(mask.shape[0]):
            word = mask[w]
            if word == -1:  # every token of the word allowed
                continue
            base = w * 32
            if word == 0 and base + 32 <= vocab_size:  # every token of the word masked
                row[base:base + 32] = neg_inf
                continue
            for b in range(32):
                t = base + b
                if t < vocab_size and (word >> b) & 1 == 0:
                    row[t] = neg_inf

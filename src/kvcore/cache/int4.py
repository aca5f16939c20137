"""The int4 KV cache block format (KIVI-style) and its NumPy reference quantizer.

A sealed int4 block is one row of bytes per layer for K and one for V, so a block stays
self-contained (copy-on-write, prefix caching and the inspector move whole rows):

    K row: nibbles (block_size, heads, head_dim // 2) uint8, then params (2, heads, head_dim) fp16
    V row: nibbles (block_size, heads, head_dim // 2) uint8, then params
           (2, block_size, heads, head_dim // group) fp16

params[0] is the scale and params[1] the zero point (the group's minimum). Keys are quantized per
channel over the block's tokens (keys have outlier channels); values per token in groups of
`group` consecutive channels. Nibble pairs: channel 2c in the low nibble of byte c, 2c + 1 in the
high nibble. A value decodes as zero + scale * q (float32 arithmetic on the fp16 parameters).

Quantizing a group x (float32):
- non-finite and out-of-range inputs saturate: NaN -> 0, +-inf and |x| > 65504 -> +-65504;
- zero = fp16(min x), scale = fp16((max x - min x) / 15);
- q = clip(floor((x - zero) / scale + 0.5), 0, 15) in float32 (IEEE division); q = 0 where
  scale == 0.
Every implementation (NumPy here, numba, CUDA) produces these bytes exactly.
"""

from __future__ import annotations

import numpy as np

FP16_MAX = 65504.0
DEFAULT_GROUP = 32  # value channels per scale


def check_layout(block_size: int, head_dim: int, group: int) -> None:
    """ValueError naming the value that the int4 layout cannot hold."""
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for an int4 cache, got {head_dim}")
    if group <= 0 or head_dim % group:
        raise ValueError(f"int4 group must divide head_dim {head_dim}, got {group}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def key_row_bytes(block_size: int, heads: int, head_dim: int) -> int:
    """Bytes of one sealed K block (nibbles + per-channel scale and zero)."""
    return block_size * heads * head_dim // 2 + 2 * 2 * heads * head_dim


def value_row_bytes(block_size: int, heads: int, head_dim: int, group: int) -> int:
    """Bytes of one sealed V block (nibbles + per-token, per-group scale and zero)."""
    return block_size * heads * head_dim // 2 + 2 * 2 * block_size * heads * (head_dim // group)


def _saturate(x: np.ndarray) -> np.ndarray:
    x = np.nan_to_num(np.asarray(x, np.float32), nan=0.0, posinf=FP16_MAX, neginf=-FP16_MAX)
    return np.clip(x, -FP16_MAX, FP16_MAX)


def _quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q uint8, scale fp16, zero fp16) of groups along `axis` (kept with size 1 in the params)."""
    x = _saturate(x)
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    zero = lo.astype(np.float16)
    scale = ((hi - lo) / np.float32(15)).astype(np.float16)
    s32, z32 = scale.astype(np.float32), zero.astype(np.float32)
    safe = np.where(s32 == 0, np.float32(1), s32)
    q = np.floor((x - z32) / safe + np.float32(0.5))
    q = np.where(s32 == 0, np.float32(0), np.clip(q, 0, 15))
    return q.astype(np.uint8), scale, zero


def _pack(q: np.ndarray) -> np.ndarray:
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _unpack(nibbles: np.ndarray) -> np.ndarray:
    out = np.empty(nibbles.shape[:-1] + (nibbles.shape[-1] * 2,), np.uint8)
    out[..., 0::2], out[..., 1::2] = nibbles & 0xF, nibbles >> 4
    return out


def quantize_key_block(k: np.ndarray) -> np.ndarray:
    """k (block_size, heads, head_dim) -> the K row (uint8)."""
    bs, heads, dim = k.shape
    check_layout(bs, dim, 2)
    q, scale, zero = _quantize(k, axis=0)  # per channel, over the block's tokens
    params = np.stack([scale[0], zero[0]])  # (2, heads, dim)
    return np.concatenate([_pack(q).reshape(-1), params.reshape(-1).view(np.uint8)])


def quantize_value_block(v: np.ndarray, group: int = DEFAULT_GROUP) -> np.ndarray:
    """v (block_size, heads, head_dim) -> the V row (uint8)."""
    bs, heads, dim = v.shape
    check_layout(bs, dim, group)
    grouped = np.asarray(v, np.float32).reshape(bs, heads, dim // group, group)
    q, scale, zero = _quantize(grouped, axis=3)
    params = np.stack([scale[..., 0], zero[..., 0]])  # (2, bs, heads, dim // group)
    return np.concatenate([_pack(q.reshape(bs, heads, dim)).reshape(-1),
                           params.reshape(-1).view(np.uint8)])


def dequantize_key_block(row: np.ndarray, block_size: int, heads: int,
                         head_dim: int) -> np.ndarray:
    """The K row -> float32 (block_size, heads, head_dim)."""
    split = block_size * heads * head_dim // 2
    q = _unpack(row[:split].reshape(block_size, heads, head_dim // 2)).astype(np.float32)
    params = row[split:key_row_bytes(block_size, heads, head_dim)].view(np.float16)
    scale, zero = params.astype(np.float32).reshape(2, 1, heads, head_dim)
    return zero + scale * q


def dequantize_value_block(row: np.ndarray, block_size: int, heads: int, head_dim: int,
                           group: int = DEFAULT_GROUP) -> np.ndarray:
    """The V row -> float32 (block_size, heads, head_dim)."""
    split = block_size * heads * head_dim // 2
    q = _unpack(row[:split].reshape(block_size, heads, head_dim // 2)).astype(np.float32)
    end = value_row_bytes(block_size, heads, head_dim, group)
    params = row[split:end].view(np.float16).astype(np.float32)
    scale, zero = params.reshape(2, block_size, heads, head_dim // group, 1)
    grouped = q.reshape(block_size, heads, head_dim // group, group)
    return (zero + scale * grouped).reshape(block_size, heads, head_dim)

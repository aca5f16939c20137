"""The int4 KV block format in numba: the sealing quantizer (bit-exact with the format's NumPy
reference, kvcore.cache.int4) and the block loaders the compiled CPU attention reads sealed
blocks with (nibbles unpacked into a float32 block in one pass, like the fp8 path).

Row layout (one sealed block of one layer, bytes): K = nibbles (bs, Hkv, D/2) then scale and
zero (2, Hkv, D) fp16, per channel over the block's tokens; V = nibbles (bs, Hkv, D/2) then
scale and zero (2, bs, Hkv, D/group) fp16, per token in groups of `group` channels. Channel 2c
sits in the low nibble of byte c. fp16 parameters are stored little-endian as two bytes, so a
row needs no alignment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from kvcore.kernels.cpu.attention_blocks import FASTMATH, float_from_half_bits

FP16_MAX = np.float32(65504.0)
_HALF = np.float32(0.5)
_FIFTEEN = np.float32(15.0)
# byte -> its low and high nibbles as two float32 (low first), as one little-endian uint64
_NIBBLE_PAIRS = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1).astype(
    np.float32).view(np.uint64).reshape(256)


@intrinsic
def _half_bits(typingctx: object, x: types.Float) -> tuple:
    """A float32 rounded to an IEEE half (nearest even, as NumPy's astype(float16)), as its
    uint16 bits."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


half_bits: Callable[[np.float32], np.uint16] = cast(Any, _half_bits)


def key_row_bytes(block_size: int, heads: int, head_dim: int) -> int:
    """Bytes of one sealed K block (as kvcore.cache.int4.key_row_bytes)."""
    return block_size * heads * head_dim // 2 + 4 * heads * head_dim


def value_row_bytes(block_size: int, heads: int, head_dim: int, group: int) -> int:
    """Bytes of one sealed V block (as kvcore.cache.int4.value_row_bytes)."""
    return block_size * heads * head_dim // 2 + 4 * block_size * heads * (head_dim // group)


@njit(cache=True)
def _saturate(x: np.float32) -> np.float32:
    if x != x:  # NaN
        return np.float32(0.0)
    return min(max(x, -FP16_MAX), FP16_MAX)


@njit(cache=True)
def _put_half(row: np.ndarray, at: int, bits: np.uint16) -> None:
    row[at] = np.uint8(bits & np.uint16(0xFF))
    row[at + 1] = np.uint8(bits >> np.uint16(8))


@njit(cache=True)
def _get_half(row: np.ndarray, at: int) -> np.float32:
    return float_from_half_bits(np.uint16(row[at]) | (np.uint16(row[at + 1]) << np.uint16(8)))


@njit(cache=True)
def _code(x: np.float32, zero: np.float32, scale: np.float32) -> np.uint8:
    """One value's nibble: floor((x - zero) / scale + 0.5) clipped to [0, 15]; 0 when scale
    is 0. IEEE float32 arithmetic with no contraction (no fastmath): the reference's bytes."""
    if scale == 0.0:
        return np.uint8(0)
    q = np.floor((_saturate(x) - zero) / scale + _HALF)
    return np.uint8(min(max(q, np.float32(0.0)), _FIFTEEN))


@njit(cache=True)
def quantize_key(block: np.ndarray, row: np.ndarray) -> None:
    """block (bs, Hkv, D) fp16 bits (uint16) -> the K row (uint8, key_row_bytes long)."""
    bs, heads, dim = block.shape
    split = bs * heads * dim // 2
    for h in range(heads):
        for d in range(dim):
            lo = _saturate(float_from_half_bits(block[0, h, d]))
            hi = lo
            for t in range(1, bs):
                x = _saturate(float_from_half_bits(block[t, h, d]))
                lo = min(lo, x)
                hi = max(hi, x)
            zero_bits = half_bits(lo)
            scale_bits = half_bits((hi - lo) / _FIFTEEN)
            _put_half(row, split + 2 * (h * dim + d), scale_bits)
            _put_half(row, split + 2 * (heads * dim + h * dim + d), zero_bits)
            zero, scale = float_from_half_bits(zero_bits), float_from_half_bits(scale_bits)
            for t in range(bs):
                q = _code(float_from_half_bits(block[t, h, d]), zero, scale)
                at = (t * heads + h) * (dim // 2) + d // 2
                if d % 2 == 0:
                    row[at] = q
                else:
                    row[at] |= q << np.uint8(4)


@njit(cache=True)
def quantize_value(block: np.ndarray, group: int, row: np.ndarray) -> None:
    """block (bs, Hkv, D) fp16 bits (uint16) -> the V row (uint8, value_row_bytes long)."""
    bs, heads, dim = block.shape
    split = bs * heads * dim // 2
    num_groups = dim // group
    num_params = bs * heads * num_groups
    for t in range(bs):
        for h in range(heads):
            for g in range(num_groups):
                lo = _saturate(float_from_half_bits(block[t, h, g * group]))
                hi = lo
                for d in range(g * group + 1, (g + 1) * group):
                    x = _saturate(float_from_half_bits(block[t, h, d]))
                    lo = min(lo, x)
                    hi = max(hi, x)
                zero_bits = half_bits(lo)
                scale_bits = half_bits((hi - lo) / _FIFTEEN)
                p = (t * heads + h) * num_groups + g
                _put_half(row, split + 2 * p, scale_bits)
                _put_half(row, split + 2 * (num_params + p), zero_bits)
                zero, scale = float_from_half_bits(zero_bits), float_from_half_bits(scale_bits)
                for d in range(g * group, (g + 1) * group, 2):
                    q0 = _code(float_from_half_bits(block[t, h, d]), zero, scale)
                    q1 = _code(float_from_half_bits(block[t, h, d + 1]), zero, scale)
                    row[(t * heads + h) * (dim // 2) + d // 2] = q0 | (q1 << np.uint8(4))


@njit(cache=True)
def seal_blocks(k_window: np.ndarray, v_window: np.ndarray, k_rows: np.ndarray,
                v_rows: np.ndarray, block_ids: np.ndarray, slots: np.ndarray,
                group: int) -> None:
    """Quantize window slot slots[i] (bs, Hkv, D; fp16 bits as uint16) into block
    block_ids[i]'s K and V rows of one layer."""
    for i in range(block_ids.shape[0]):
        quantize_key(k_window[slots[i]], k_rows[block_ids[i]])
        quantize_value(v_window[slots[i]], group, v_rows[block_ids[i]])


@njit(fastmath=FASTMATH, cache=True)
def _unpack_codes(row: np.ndarray, num_bytes: int, dst: np.ndarray) -> None:
    """Byte c of row -> its two codes as float32 into dst[2c], dst[2c + 1]: one 8-byte store
    from a 256-entry table per byte (a loop over elements would read each byte twice and
    shift by its parity)."""
    pairs = dst.view(np.uint64)  # (bs * Hkv * D / 2,) two float32 each
    for c in range(num_bytes):
        pairs[c] = _NIBBLE_PAIRS[row[c]]


@njit(fastmath=FASTMATH, cache=True)
def load_key_row(rows: np.ndarray, block_id: int, params: np.ndarray, out: np.ndarray) -> None:
    """A sealed K block as float32 into out (bs, Hkv, D): codes unpacked by table, then
    zero + scale * code in one contiguous pass per token (the per-channel parameters read
    once), which vectorizes."""
    bs, heads, dim = out.shape
    row = rows[block_id].reshape(rows[block_id].size)  # rows (n, bytes) or (n, 1, 1, bytes)
    row_elems = heads * dim
    split = bs * row_elems // 2
    # params (2 * Hkv * D,) scratch: the scales, then the zeros, as float32
    for j in range(2 * row_elems):
        params[j] = _get_half(row, split + 2 * j)
    dst = out.reshape(out.size)
    _unpack_codes(row, split, dst)
    for t in range(bs):
        base = t * row_elems
        for j in range(row_elems):
            dst[base + j] = params[row_elems + j] + params[j] * dst[base + j]


@njit(fastmath=FASTMATH, cache=True)
def load_value_row(rows: np.ndarray, block_id: int, group: int, out: np.ndarray) -> None:
    """A sealed V block as float32 into out (bs, Hkv, D): codes unpacked by table, then one
    scale and zero per token and group of channels over the group's contiguous elements."""
    bs, heads, dim = out.shape
    row = rows[block_id].reshape(rows[block_id].size)  # rows (n, bytes) or (n, 1, 1, bytes)
    split = bs * heads * dim // 2
    num_params = bs * heads * (dim // group)
    dst = out.reshape(out.size)
    _unpack_codes(row, split, dst)
    for p in range(num_params):  # p = (t * heads + h) * num_groups + g
        scale = _get_half(row, split + 2 * p)
        zero = _get_half(row, split + 2 * (num_params + p))
        for i in range(p * group, (p + 1) * group):
            dst[i] = zero + scale * dst[i]


@njit(fastmath=FASTMATH, cache=True)
def load_int4_block(rows: np.ndarray, window: np.ndarray, window_slot: np.ndarray,
                    block_id: int, group: int, params: np.ndarray, from_window: bool,
                    out: np.ndarray) -> None:
    """Block block_id of an int4 cache's K (group 0) or V as float32 into out (bs, Hkv, D):
    from its window slot (fp16 bits) when `from_window` (the reading row's own super-block),
    else from its sealed row."""
    if from_window:
        slot = window_slot[block_id]
        src = window[slot].reshape(out.size)
        dst = out.reshape(out.size)
        for j in range(dst.shape[0]):
            dst[j] = float_from_half_bits(np.uint16(src[j]))
    elif group == 0:
        load_key_row(rows, block_id, params, out)
    else:
        load_value_row(rows, block_id, group, out)

"""Register loads for the int4 attention tiles (kvcore.kernels.cpu.kv_int4_tiles): 16 bytes of
nibble codes as two 16-lane float32 vectors (low nibbles, high nibbles), and fp16 parameters
stored as raw bytes in a row widened to float32, whole or split into even and odd channels.

An int4 row keeps channel 2c in the low nibble of byte c and 2c + 1 in the high one, so the
16 bytes of a 32-channel chunk give its even channels (low nibbles) and its odd channels (high
nibbles) without shuffling a lane: the tiles keep queries, key scales and value accumulators in
that "split" order (per chunk of 32 channels: 16 even, then 16 odd) instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvcore.kernels.cpu.simd import LANES, float32x16

CHUNK = 2 * LANES  # channels per 16 code bytes
_I32 = ir.IntType(32)
_BYTES = ir.VectorType(ir.IntType(8), LANES)
_WORDS = ir.VectorType(_I32, LANES)
_FLOATS = ir.VectorType(ir.FloatType(), LANES)


def _byte_pointer(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    """An i8* at array[index] (a C-contiguous 1-D uint8 array; no bounds check: the callers'
    loops keep what they read inside the row)."""
    data = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, data, [index],
                                    wraparound=False)


def _codes(high: bool) -> Callable[..., Any]:
    @intrinsic
    def codes(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
        sig = float32x16(array, index)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
            raw = builder.load(builder.bitcast(ptr, _BYTES.as_pointer()), align=1)
            wide = builder.zext(raw, _WORDS)
            if high:
                nibbles = builder.lshr(wide, ir.Constant(_WORDS, [4] * LANES))
            else:
                nibbles = builder.and_(wide, ir.Constant(_WORDS, [15] * LANES))
            return builder.sitofp(nibbles, _FLOATS)  # 0..15: exact
        return sig, codegen
    return cast(Callable[..., Any], codes)


def _halves(lanes: list[int]) -> Callable[..., Any]:
    """An intrinsic: the fp16 values (little-endian byte pairs) at array[index:index + 64],
    lanes `lanes` of the 32, widened to float32 (exact)."""
    width = 2 * LANES if max(lanes) >= LANES else LANES
    raw_type = ir.VectorType(ir.HalfType(), width)
    mask = ir.Constant(_WORDS, lanes)

    @intrinsic
    def halves(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
        sig = float32x16(array, index)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            ptr = _byte_pointer(context, builder, signature.args[0], args[0], args[1])
            raw = builder.load(builder.bitcast(ptr, raw_type.as_pointer()), align=1)
            picked = builder.shuffle_vector(raw, ir.Constant(raw_type, ir.Undefined), mask)
            return builder.fpext(picked, _FLOATS)
        return sig, codegen
    return cast(Callable[..., Any], halves)


@intrinsic
def _mul(typingctx: object, a: types.Type, b: types.Type) -> tuple:
    sig = float32x16(float32x16, float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fmul(args[0], args[1])
    return sig, codegen


@intrinsic
def _total(typingctx: object, a: types.Type) -> tuple:
    """The sum of a vector's 16 lanes (a tree of halving adds)."""
    sig = types.float32(float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        v = args[0]
        width = LANES
        while width > 1:
            width //= 2
            upper = [j + width if j < width else j for j in range(LANES)]
            v = builder.fadd(v, builder.shuffle_vector(v, ir.Constant(_FLOATS, ir.Undefined),
                                                       ir.Constant(_WORDS, upper)))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return sig, codegen


# typed names (mypy cannot see through @intrinsic); vectors are Any to mypy
low_codes: Callable[[Any, int], Any] = _codes(high=False)  # bytes[i:i + 16] & 15
high_codes: Callable[[Any, int], Any] = _codes(high=True)  # bytes[i:i + 16] >> 4
halves: Callable[[Any, int], Any] = _halves(list(range(LANES)))  # 16 fp16 at bytes[i:i + 32]
even_halves: Callable[[Any, int], Any] = _halves(list(range(0, CHUNK, 2)))  # of 32 fp16
odd_halves: Callable[[Any, int], Any] = _halves(list(range(1, CHUNK, 2)))
mul: Callable[[Any, Any], Any] = cast(Any, _mul)
total: Callable[[Any], Any] = cast(Any, _total)

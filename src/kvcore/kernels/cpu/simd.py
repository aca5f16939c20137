"""16-lane float32 vectors for numba kernels: a numba type held in a register (LLVM's
<16 x float>, one AVX-512 register or two AVX2 ones) and the handful of operations the
attention tiles need. numba's loop vectorizer cannot keep an accumulator tile in registers
across a loop over keys (it cannot prove the accumulator and the block do not alias); with these
the tile is plain SSA values, loaded once and stored once per block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel.models import PrimitiveModel
from numba.extending import intrinsic, register_model

LANES = 16
_VECTOR = ir.VectorType(ir.FloatType(), LANES)


class Float32x16(types.Type):
    """numba's type of a <16 x float> value."""

    def __init__(self) -> None:
        super().__init__(name="Float32x16")


float32x16 = Float32x16()


@register_model(Float32x16)
class _Float32x16Model(PrimitiveModel):
    def __init__(self, dmm, fe_type):  # type: ignore[no-untyped-def]
        super().__init__(dmm, fe_type, _VECTOR)


def _lane_pointer(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    """A <16 x float>* at array[index] (a C-contiguous 1-D float32 array; no bounds check:
    the caller's loops keep index + 16 within the array)."""
    data = context.make_array(array_type)(context, builder, array)
    ptr = cgutils.get_item_pointer(context, builder, array_type, data, [index], wraparound=False)
    return builder.bitcast(ptr, _VECTOR.as_pointer())


@intrinsic
def _load(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
    sig = float32x16(array, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _lane_pointer(context, builder, signature.args[0], args[0], args[1])
        return builder.load(ptr, align=4)
    return sig, codegen


@intrinsic
def _store(typingctx: object, array: types.Array, index: types.Integer,
           value: Float32x16) -> tuple:
    sig = types.void(array, index, value)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ptr = _lane_pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], ptr, align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _splat(typingctx: object, value: types.Float) -> tuple:
    sig = float32x16(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), args[0],
                                     ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                                  [0] * LANES))
    return sig, codegen


@intrinsic
def _muladd(typingctx: object, a: Float32x16, b: Float32x16, c: Float32x16) -> tuple:
    """a * b + c, fused where the CPU has FMA (llvm.fmuladd)."""
    sig = float32x16(float32x16, float32x16, float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), "llvm.fmuladd.v16f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _fma(typingctx: object, a: Float32x16, b: Float32x16, c: Float32x16) -> tuple:
    """a * b + c with one rounding (llvm.fma): the same bits on every target and in every
    code path, where llvm.fmuladd leaves fusing to the backend."""
    sig = float32x16(float32x16, float32x16, float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_VECTOR, [_VECTOR] * 3), "llvm.fma.v16f32")
        return builder.call(fn, args)
    return sig, codegen


@intrinsic
def _store_halves(typingctx: object, first: types.Array, second: types.Array,
                  index: types.Integer, value: Float32x16) -> tuple:
    """Lanes 0-7 of value into first[index:index + 8], lanes 8-15 into second[index:index + 8]
    (C-contiguous 1-D float32 arrays; no bounds check)."""
    sig = types.void(first, second, index, value)
    half = ir.VectorType(ir.FloatType(), LANES // 2)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        for k in range(2):
            array_type = signature.args[k]
            data = context.make_array(array_type)(context, builder, args[k])
            ptr = cgutils.get_item_pointer(context, builder, array_type, data, [args[2]],
                                           wraparound=False)
            lanes = ir.Constant(ir.VectorType(ir.IntType(32), LANES // 2),
                                list(range(k * LANES // 2, (k + 1) * LANES // 2)))
            part = builder.shuffle_vector(args[3], ir.Constant(_VECTOR, ir.Undefined), lanes)
            builder.store(part, builder.bitcast(ptr, half.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _splat_at(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
    """array[index] (a C-contiguous 1-D float32 array) in every lane: one broadcast load, with
    no negative-index wraparound (the caller keeps index inside the array)."""
    sig = float32x16(array, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array_type, data, [args[1]],
                                       wraparound=False)
        one = builder.insert_element(ir.Constant(_VECTOR, ir.Undefined), builder.load(ptr),
                                     ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(_VECTOR, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                                  [0] * LANES))
    return sig, codegen


@intrinsic
def _store_split(typingctx: object, array: types.Array, first: types.Integer,
                 second: types.Integer, value: Float32x16) -> tuple:
    """Lanes 0-7 of value into array[first:first + 8], lanes 8-15 into array[second:second +
    8] (a C-contiguous 1-D float32 array; no bounds check)."""
    sig = types.void(array, first, second, value)
    half = ir.VectorType(ir.FloatType(), LANES // 2)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        for k in range(2):
            ptr = cgutils.get_item_pointer(context, builder, array_type, data, [args[1 + k]],
                                           wraparound=False)
            lanes = ir.Constant(ir.VectorType(ir.IntType(32), LANES // 2),
                                list(range(k * LANES // 2, (k + 1) * LANES // 2)))
            part = builder.shuffle_vector(args[3], ir.Constant(_VECTOR, ir.Undefined), lanes)
            builder.store(part, builder.bitcast(ptr, half.as_pointer()), align=4)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _add(typingctx: object, a: Float32x16, b: Float32x16) -> tuple:
    sig = float32x16(float32x16, float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fadd(args[0], args[1])
    return sig, codegen


def _halving_masks(width: int) -> tuple[list[int], list[int]]:
    """Shuffle masks that halve the partial sums of two vectors x, y (lanes 0-15 and 16-31 of
    the pair) each holding 16 / width sources of `width` partial sums in contiguous lanes:
    lo + hi puts x's sources, now of width / 2 partials, in lanes 0-7 and y's in 8-15."""
    half = width // 2
    lo, hi = [], []
    for lane in range(LANES):
        operand, j = divmod(lane, LANES // 2)
        source, k = divmod(j, half)
        lo.append(operand * LANES + source * width + k)
        hi.append(operand * LANES + source * width + half + k)
    return lo, hi


@intrinsic
def _sums16(typingctx: object, vectors: types.UniTuple) -> tuple:
    """16 vectors -> one vector of their 16 lane sums (lane j: the sum of vector j): a tree of
    15 adds over shuffled pairs, a third of what 16 separate reductions cost."""
    sig = float32x16(vectors)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        level = [builder.extract_value(args[0], j) for j in range(LANES)]
        width = LANES
        while len(level) > 1:
            lo_mask, hi_mask = (ir.Constant(ir.VectorType(ir.IntType(32), LANES), m)
                                for m in _halving_masks(width))
            level = [builder.fadd(builder.shuffle_vector(x, y, lo_mask),
                                  builder.shuffle_vector(x, y, hi_mask))
                     for x, y in zip(level[::2], level[1::2], strict=True)]
            width //= 2
        return level[0]
    return sig, codegen


@intrinsic
def _hsum(typingctx: object, a: Float32x16) -> tuple:
    """The sum of a vector's 16 lanes by halving (lane k + lane k + 8, then k + 4, k + 2,
    k + 1): for each vector the same tree as `sums16`, so one sum and sixteen at once agree
    bit for bit."""
    sig = types.float32(float32x16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        vector, lanes = args[0], LANES
        while lanes > 1:
            lanes //= 2
            mask = ir.VectorType(ir.IntType(32), lanes)
            low = builder.shuffle_vector(vector, vector, ir.Constant(mask, list(range(lanes))))
            high = builder.shuffle_vector(vector, vector,
                                          ir.Constant(mask, list(range(lanes, 2 * lanes))))
            vector = builder.fadd(low, high)
        return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))
    return sig, codegen


# typed names (mypy cannot see through @intrinsic; numba resolves these globals to the
# intrinsics themselves). Vectors are Any to mypy.
load: Callable[[Any, int], Any] = cast(Any, _load)  # array[index:index + 16]
store: Callable[[Any, int, Any], None] = cast(Any, _store)  # array[index:index + 16] = value
splat: Callable[[Any], Any] = cast(Any, _splat)  # a float32 in every lane
muladd: Callable[[Any, Any, Any], Any] = cast(Any, _muladd)
fma: Callable[[Any, Any, Any], Any] = cast(Any, _fma)  # a * b + c, one rounding
hsum: Callable[[Any], float] = cast(Any, _hsum)  # the lanes' sum, sums16's tree
add: Callable[[Any, Any], Any] = cast(Any, _add)
splat_at: Callable[[Any, int], Any] = cast(Any, _splat_at)  # array[index] in every lane
store_split: Callable[[Any, int, int, Any], None] = cast(Any, _store_split)
sums16: Callable[[tuple], Any] = cast(Any, _sums16)  # (16 vectors) -> their lane sums
store_halves: Callable[[Any, Any, int, Any], None] = cast(Any, _store_halves)

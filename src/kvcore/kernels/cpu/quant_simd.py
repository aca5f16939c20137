"""Integer dot-product steps for the quantized-weight kernels, as numba intrinsics over LLVM's
x86 intrinsics: AVX-512 VNNI (`vpdpbusd`, 64 bytes a step) or AVX2 (`vpmaddubsw` + `vpmaddwd`,
32 bytes a step).

numba's own loops never reach these instructions (it types an int8 x int8 product as int64), so
each step is spelled out in LLVM IR. Activations carry a scale per block of 32 (llama.cpp's
Q8_0 activations: one scale per row let outlier channels swamp the rest, measured 4% on
perplexity), so a step's integer sums are scaled into float lanes at once. The instruction
set is chosen by the dtype of `isa`, a zero-length array the caller passes (VNNI: uint16,
AVX2: uint8): numba compiles one specialization per dtype, only when it is first called, so
a CPU without VNNI never even compiles (let alone runs) the VNNI code. Both instructions
multiply unsigned by signed bytes: VNNI flips the int8 activations to unsigned (a + 128, an
xor of the top bit) and the caller subtracts 128 x the weight sums; AVX2 moves the
activation's sign onto the weight (|a| and sign(a) w, llama.cpp's trick), which keeps
vpmaddubsw's 16-bit pair sums from saturating; q4's nibbles are unsigned already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.datamodel.models import PrimitiveModel
from numba.extending import intrinsic, register_model

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


class SimdVector(types.Type):
    """numba's type of an LLVM vector held in registers (<lanes x i32> or <lanes x float>)."""

    def __init__(self, kind: str, lanes: int) -> None:
        self.kind, self.lanes = kind, lanes
        super().__init__(name=f"SimdVector({kind}x{lanes})")

    def ir_type(self) -> ir.VectorType:
        return ir.VectorType(_I32 if self.kind == "i32" else _F32, self.lanes)


@register_model(SimdVector)
class _SimdVectorModel(PrimitiveModel):
    def __init__(self, dmm, fe_type):  # type: ignore[no-untyped-def]
        super().__init__(dmm, fe_type, fe_type.ir_type())


def _wide(isa: types.Array) -> bool:
    """True for the AVX-512 VNNI specialization (isa is a uint16 array), False for AVX2."""
    return bool(isa.dtype == types.uint16)


def _ptr(context, builder, array_type, array, index, vector):  # type: ignore[no-untyped-def]
    """A vector* at array[index] (1-D C-contiguous; no bounds check: the kernels keep every
    index inside the padded arrays)."""
    data = context.make_array(array_type)(context, builder, array)
    ptr = cgutils.get_item_pointer(context, builder, array_type, data, [index], wraparound=False)
    return builder.bitcast(ptr, vector.as_pointer())


def _load(context, builder, array_type, array, index, vector):  # type: ignore[no-untyped-def]
    return builder.load(_ptr(context, builder, array_type, array, index, vector), align=1)


def _call(builder, name, ret, args):  # type: ignore[no-untyped-def]
    fn = cgutils.get_or_insert_function(builder.module,
                                        ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, value, vector):  # type: ignore[no-untyped-def]
    return ir.Constant(vector, [value] * vector.count) if isinstance(value, (int, float)) \
        else builder.shuffle_vector(
            builder.insert_element(ir.Constant(vector, ir.Undefined), value,
                                   ir.Constant(_I32, 0)),
            ir.Constant(vector, ir.Undefined),
            ir.Constant(ir.VectorType(_I32, vector.count), [0] * vector.count))


def _vnni(builder, acc, unsigned, signed):  # type: ignore[no-untyped-def]
    """acc (<16 x i32>) += 4-byte dot products of unsigned x signed (<64 x i8> each)."""
    v16 = ir.VectorType(_I32, 16)
    return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                 [acc, builder.bitcast(unsigned, v16), builder.bitcast(signed, v16)])


def _avx2_dot(builder, unsigned, signed):  # type: ignore[no-untyped-def]
    """<8 x i32> 4-byte dot products of unsigned x signed (<32 x i8> each): vpmaddubsw then
    vpmaddwd by ones (exact while every byte pair sums within int16)."""
    pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", ir.VectorType(_I16, 16),
                  [unsigned, signed])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8),
                 [pairs, ir.Constant(ir.VectorType(_I16, 16), [1] * 16)])


def _sign_moved(builder, a, w):  # type: ignore[no-untyped-def]
    """(|a|, sign(a) * w): the same products, with the sign carried by the weight byte."""
    zero = ir.Constant(a.type, [0] * a.type.count)
    negative = builder.icmp_signed("<", a, zero)
    magnitude = builder.select(negative, builder.sub(zero, a), a)
    signed = builder.select(negative, builder.sub(zero, w),
                            builder.select(builder.icmp_signed("==", a, zero), zero, w))
    return magnitude, signed


def _flip(builder, a):  # type: ignore[no-untyped-def]
    """int8 -> uint8 bytes a + 128 (xor of the top bit)."""
    return builder.xor(a, ir.Constant(a.type, [-128] * a.type.count))


@intrinsic
def _fzero(typingctx: object, isa: types.Array) -> tuple:
    vector = SimdVector("f32", 16 if _wide(isa) else 8)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return ir.Constant(vector.ir_type(), [0.0] * vector.lanes)
    return vector(isa), codegen


@intrinsic
def _step(typingctx: object, isa: types.Array) -> tuple:
    """Weights consumed by one dot step: 64 (VNNI) or 32 (AVX2)."""
    width = 64 if _wide(isa) else 32

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return ir.Constant(ir.IntType(64), width)
    return types.int64(isa), codegen


def _block_scales(context, builder, d_type, d_arr, d_i, wide, lane_block):  # type: ignore[no-untyped-def]
    """The float scale of each i32 lane of one step: AVX2's step is one block (its scale in
    every lane); VNNI's two, lane l from block lane_block[l]."""
    if not wide:
        data = context.make_array(d_type)(context, builder, d_arr)
        scale = builder.load(cgutils.get_item_pointer(context, builder, d_type, data, [d_i],
                                                      wraparound=False))
        return _splat(builder, scale, ir.VectorType(_F32, 8))
    pair = _load(context, builder, d_type, d_arr, d_i, ir.VectorType(_F32, 2))
    return builder.shuffle_vector(pair, ir.Constant(ir.VectorType(_F32, 2), ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 16), lane_block))


# VNNI, q4: the 32 packed bytes of two blocks unpack to [block 0 low nibbles, block 1 low,
# block 0 high, block 1 high] (16 each: no cross-lane shuffle); activations are permuted to the
# same order when quantized (quant_gemm.quantize_rows, permute=True), and i32 lane l then
# belongs to block Q4_LANE_BLOCK[l]. q8's bytes (and activations) stay in order.
Q4_LANE_BLOCK = [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
Q8_LANE_BLOCK = [0] * 8 + [1] * 8


@intrinsic
def _dot_blocks(typingctx: object, isa: types.Array, acc: SimdVector, q: types.Array,
                q_index: types.Integer, a: types.Array, a_index: types.Integer,
                d: types.Array, d_index: types.Integer, s: types.Array,
                s_index: types.Integer) -> tuple:
    """acc (float lanes) + weight scale x activation scale x the integer dot products of one
    step: block-quantized weights q (uint8 packed nibbles 0..15: q4; int8: q8 and int8) from
    weight q_index, int8 activations a[a_index:+step], the blocks' weight scales from
    d[d_index] and activation scales from s[s_index]. int8 / q8 on VNNI sum (a + 128) q: the
    caller subtracts 128 x the scaled block sums of q."""
    wide, q4 = _wide(isa), q.dtype == types.uint8
    sig = acc(isa, acc, q, q_index, a, a_index, d, d_index, s, s_index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        _, acc_v, q_arr, q_i, a_arr, a_i, d_arr, d_i, s_arr, s_i = args
        types_ = signature.args
        step = 64 if wide else 32
        av = _load(context, builder, types_[4], a_arr, a_i, ir.VectorType(_I8, step))
        if q4:
            packed_t = ir.VectorType(_I8, step // 2)
            byte = builder.lshr(q_i, ir.Constant(q_i.type, 1))
            packed = _load(context, builder, types_[2], q_arr, byte, packed_t)
            low = builder.and_(packed, ir.Constant(packed_t, [15] * packed_t.count))
            high = builder.lshr(packed, ir.Constant(packed_t, [4] * packed_t.count))
            weights = builder.shuffle_vector(low, high,
                                             ir.Constant(ir.VectorType(_I32, step),
                                                         list(range(step))))
            if wide:
                dots = _vnni(builder, ir.Constant(ir.VectorType(_I32, 16), [0] * 16),
                             weights, av)
            else:
                dots = _avx2_dot(builder, weights, av)  # nibbles x int8: no saturation
        else:
            wv = _load(context, builder, types_[2], q_arr, q_i, ir.VectorType(_I8, step))
            if wide:
                dots = _vnni(builder, ir.Constant(ir.VectorType(_I32, 16), [0] * 16),
                             _flip(builder, av), wv)
            else:
                dots = _avx2_dot(builder, *_sign_moved(builder, av, wv))
        lane_block = Q4_LANE_BLOCK if q4 else Q8_LANE_BLOCK
        scales = builder.fmul(
            _block_scales(context, builder, types_[6], d_arr, d_i, wide, lane_block),
            _block_scales(context, builder, types_[8], s_arr, s_i, wide, lane_block))
        floats = builder.sitofp(dots, scales.type)
        return _call(builder, f"llvm.fmuladd.v{scales.type.count}f32", scales.type,
                     [floats, scales, acc_v])
    return sig, codegen


def _tree_sum(builder, vector, add):  # type: ignore[no-untyped-def]
    """The sum of a vector's lanes by halving (log2(lanes) shuffles and adds)."""
    lanes = vector.type.count
    while lanes > 1:
        lanes //= 2
        mask = ir.VectorType(_I32, lanes)
        low = builder.shuffle_vector(vector, vector, ir.Constant(mask, list(range(lanes))))
        high = builder.shuffle_vector(vector, vector,
                                      ir.Constant(mask, list(range(lanes, 2 * lanes))))
        vector = add(low, high)
    return builder.extract_element(vector, ir.Constant(_I32, 0))


@intrinsic
def _fsum(typingctx: object, acc: SimdVector) -> tuple:
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return _tree_sum(builder, args[0], builder.fadd)
    return types.float32(acc), codegen


# typed names (mypy cannot see through @intrinsic; numba resolves these globals to the
# intrinsics themselves). Vectors are Any to mypy.
fzero: Callable[[Any], Any] = cast(Any, _fzero)  # float32 accumulator of the isa
step: Callable[[Any], int] = cast(Any, _step)  # weights per dot step
dot_blocks: Callable[[Any, Any, Any, int, Any, int, Any, int, Any, int], Any] = cast(
    Any, _dot_blocks)
fsum: Callable[[Any], float] = cast(Any, _fsum)  # lane sum of a float32 accumulator

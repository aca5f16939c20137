"""Block-level pieces of the compiled CPU attention (numba): a block of K or V read as float32,
exp over a tile of scores in vectorizable loops, and a software prefetch of the next block."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# modes: how a cache element's raw bits (the cache viewed as unsigned ints) become a float32
MODE_FP32, MODE_BF16, MODE_FP16, MODE_FP8 = 0, 1, 2, 3
# float contractions and reassociation (vectorized dot products over head_dim); not "ninf" or
# "nnan": masked scores are -inf and the softmax relies on exp(-inf) = 0
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_HALF_EXP_ADJUST = np.float32(2.0**112)  # fp16 bits << 13, read as fp32, times this: the value
# exp(x) = 2^n exp(r): ln 2 in two parts (Cody-Waite) and Cephes' expf polynomial for exp(r)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_C1, _EXP_C2 = np.float32(5.0000001201e-1), np.float32(1.6666665459e-1)
_EXP_C3, _EXP_C4 = np.float32(4.1665795894e-2), np.float32(8.3334519073e-3)
_EXP_C5, _EXP_C6 = np.float32(1.3981999507e-3), np.float32(1.9875691500e-4)
CACHE_LINE = 64  # bytes


@intrinsic
def _prefetch(typingctx: object, array: types.Array, index: types.Integer) -> tuple:
    """llvm.prefetch (read, keep in all cache levels) of array's element `index` (1-D)."""
    sig = types.void(array, index)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        array_type = signature.args[0]
        data = context.make_array(array_type)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, array_type, data, [args[1]],
                                       wraparound=False)
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, byte_ptr), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True)
def prefetch_block(cache: np.ndarray, block_id: int) -> None:
    """Ask for a block's cache lines ahead of its use: blocks lie wherever the pool put them,
    so the hardware prefetcher cannot guess the next one, and the loads of a block would
    otherwise wait on memory while no arithmetic runs."""
    flat = cache[block_id].reshape(cache[block_id].size)
    for j in range(0, flat.size, CACHE_LINE // cache.itemsize):
        _prefetch(flat, j)  # type: ignore[call-arg, arg-type]


@njit(fastmath=FASTMATH, cache=True)
def load_block(cache: np.ndarray, block_id: int, mode: int, fp8_table: np.ndarray,
                out: np.ndarray, out_bits: np.ndarray) -> None:
    """One block (every slot and KV head) as float32 into out, flat (bs * Hkv * D,); out_bits
    is out's uint32 view (the 16-bit conversions assemble float32 bits). A block lies
    contiguous in the cache: one sequential read, one vectorized loop."""
    src = cache[block_id].reshape(out.shape[0])  # (bs * Hkv * D,)
    n = out.shape[0]
    if mode == MODE_FP32:
        for j in range(n):
            out_bits[j] = np.uint32(src[j])
    elif mode == MODE_BF16:  # bf16 is the top half of a float32
        for j in range(n):
            out_bits[j] = np.uint32(src[j]) << np.uint32(16)
    elif mode == MODE_FP16:
        # exponent and mantissa moved into float32 position, then rescaled by 2^(127 - 15):
        # exact for normal and subnormal halves; sign, inf and nan patched in after
        for j in range(n):
            out_bits[j] = (np.uint32(src[j]) & np.uint32(0x7FFF)) << np.uint32(13)
        for j in range(n):
            out[j] *= _HALF_EXP_ADJUST
        for j in range(n):
            bits = np.uint32(src[j])
            special = np.uint32(0x7F800000) if (bits & np.uint32(0x7C00)) == np.uint32(
                0x7C00) else np.uint32(0)
            out_bits[j] |= ((bits & np.uint32(0x8000)) << np.uint32(16)) | special
    else:
        for j in range(n):
            out[j] = fp8_table[src[j]]


@njit(fastmath=FASTMATH, cache=True)
def exp_rows(probs: np.ndarray, bits: np.ndarray, row_max: np.ndarray) -> None:
    """probs[i, t] = exp(probs[i, t] - row_max[i]) in two vectorizable loops per row (a libm
    exp per score does not vectorize): 2^n assembled from its bits in `bits` (a uint32 array
    of probs' shape), exp(r) by Cephes' polynomial. Arguments below -87 (-inf: masked keys)
    give 0; a row_max of -inf (nothing seen yet) counts as 0."""
    scratch = bits.view(np.float32)
    for i in range(probs.shape[0]):
        m = row_max[i] if row_max[i] > -np.inf else np.float32(0.0)
        for t in range(probs.shape[1]):
            x = probs[i, t] - m
            xc = max(x, np.float32(-87.0))
            n = np.floor(xc * _LOG2E + np.float32(0.5))
            r = xc - n * _LN2_HI - n * _LN2_LO  # exp(x) = 2^n exp(r), |r| <= ln2 / 2
            p = _EXP_C6 * r + _EXP_C5
            p = p * r + _EXP_C4
            p = p * r + _EXP_C3
            p = p * r + _EXP_C2
            p = p * r + _EXP_C1
            p = p * r * r + r + np.float32(1.0)
            bits[i, t] = np.uint32(np.int32(n) + 127) << np.uint32(23)
            probs[i, t] = p if x > np.float32(-87.0) else np.float32(0.0)
        for t in range(probs.shape[1]):
            probs[i, t] *= scratch[i, t]

"""Block-level pieces of the compiled CPU attention (numba): a block of K or V read as float32 in
one vectorized pass, a block's scores and weighted values with the key loop unrolled by four,
exp over a tile of scores in vectorizable loops, and a software prefetch of the next block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# modes: how a cache element's raw bits (the cache viewed as unsigned ints) become a float32
MODE_FP32, MODE_BF16, MODE_FP16, MODE_FP8 = 0, 1, 2, 3
MODE_INT4 = 4  # sealed int4 rows or fp16 window slots (kvcore.kernels.cpu.kv_int4_blocks)
# float contractions and reassociation (vectorized dot products over head_dim); not "ninf" or
# "nnan": masked scores are -inf and the softmax relies on exp(-inf) = 0
FASTMATH = {"reassoc", "contract", "nsz", "arcp"}
_FP8_EXP_ADJUST = np.float32(2.0**120)  # e4m3 bits << 20, read as fp32, times this: the value
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


@intrinsic
def _float_from_bits(typingctx: object, bits: types.Integer) -> tuple:
    """A uint32's bits read as a float32, in a register: a bitcast through memory (a uint32
    view of a float32 array) would cost a store and a load per element and stop the loop from
    vectorizing."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@intrinsic
def _float_from_half_bits(typingctx: object, bits: types.Integer) -> tuple:
    """A uint16's bits read as an IEEE half and widened to float32 (exact; numba has no float16
    arithmetic on the CPU): vectorizes into the CPU's half conversion (F16C) where there is one."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


# typed names for the two conversions (mypy cannot see through @intrinsic; numba resolves these
# globals to the intrinsics themselves)
float_from_bits: Callable[[np.uint32], np.float32] = cast(Any, _float_from_bits)
float_from_half_bits: Callable[[np.uint16], np.float32] = cast(Any, _float_from_half_bits)


@njit(cache=True)
def prefetch_block(cache: np.ndarray, block_id: int) -> None:
    """Ask for a block's cache lines ahead of its use: blocks lie wherever the pool put them,
    so the hardware prefetcher cannot guess the next one, and the loads of a block would
    otherwise wait on memory while no arithmetic runs."""
    flat = cache[block_id].reshape(cache[block_id].size)
    for j in range(0, flat.size, CACHE_LINE // cache.itemsize):
        _prefetch(flat, j)  # type: ignore[call-arg, arg-type]


@njit(fastmath=FASTMATH, cache=True)
def load_block(cache: np.ndarray, block_id: int, mode: int, out: np.ndarray) -> None:
    """One block (every slot and KV head) of a 16-bit or fp8 cache (viewed as unsigned ints)
    as float32 into out (bs, Hkv, D): one sequential read, one vectorized pass, exact for every
    bit pattern. bf16 is the top half of a float32; fp16 widens as a half; e4m3's exponent and
    mantissa move into float32 position and are rescaled by 2^(127 - 7) (exact for normals and
    subnormals), its sign and NaN (S.1111.111) patched in by selects."""
    src = cache[block_id].reshape(out.size)  # (bs * Hkv * D,)
    dst = out.reshape(out.size)
    if mode == MODE_BF16:
        for j in range(dst.shape[0]):
            dst[j] = float_from_bits(np.uint32(src[j]) << np.uint32(16))
    elif mode == MODE_FP16:
        for j in range(dst.shape[0]):
            dst[j] = float_from_half_bits(np.uint16(src[j]))
    else:
        for j in range(dst.shape[0]):
            bits = np.uint32(src[j])
            magnitude = bits & np.uint32(0x7F)
            x = float_from_bits(magnitude << np.uint32(20)) * _FP8_EXP_ADJUST
            x = np.float32(np.nan) if magnitude == np.uint32(0x7F) else x
            dst[j] = -x if bits & np.uint32(0x80) else x


@njit(fastmath=FASTMATH, cache=True)
def block_scores(queries: np.ndarray, keys: np.ndarray, num_heads: int, group: int,
                 scores: np.ndarray) -> None:
    """scores (V, bs) = queries (V, D) . keys (bs, Hkv, D) of each vector's KV head; vector i
    is query head i % num_heads. Two vectors of one KV head against four keys per pass: each
    key row loaded serves both, each query row four keys, and the eight sums share one
    vectorized loop over head_dim (a horizontal reduction per score is what the loop costs)."""
    block_size, head_dim = keys.shape[0], keys.shape[2]
    full = block_size - block_size % 4
    i = 0
    while i < queries.shape[0]:
        kv_head = (i % num_heads) // group
        j = i + 1 if i + 1 < queries.shape[0] and (i + 1) % num_heads // group == kv_head else i
        # (a lone vector, the last of its KV head's, pairs with itself)
        qa, qb = queries[i], queries[j]
        for t in range(0, full, 4):
            k0, k1, k2, k3 = keys[t, kv_head], keys[t + 1, kv_head], keys[t + 2, kv_head], \
                keys[t + 3, kv_head]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for d in range(head_dim):
                x, y = qa[d], qb[d]
                a0 += x * k0[d]
                a1 += x * k1[d]
                a2 += x * k2[d]
                a3 += x * k3[d]
                b0 += y * k0[d]
                b1 += y * k1[d]
                b2 += y * k2[d]
                b3 += y * k3[d]
            scores[i, t], scores[i, t + 1], scores[i, t + 2], scores[i, t + 3] = a0, a1, a2, a3
            scores[j, t], scores[j, t + 1], scores[j, t + 2], scores[j, t + 3] = b0, b1, b2, b3
        for t in range(full, block_size):
            k0 = keys[t, kv_head]
            a0 = b0 = np.float32(0.0)
            for d in range(head_dim):
                a0 += qa[d] * k0[d]
                b0 += qb[d] * k0[d]
            scores[i, t], scores[j, t] = a0, b0
        i = j + 1


@njit(fastmath=FASTMATH, cache=True)
def block_values(probs: np.ndarray, values: np.ndarray, num_heads: int, group: int,
                 acc: np.ndarray, row_sum: np.ndarray) -> None:
    """acc (V, D) += probs (V, bs) @ values (bs, Hkv, D) of each vector's KV head, and
    row_sum (V,) += the probabilities: four keys per pass over head_dim, so each accumulator
    element is loaded and stored once per four keys rather than once per key."""
    block_size = values.shape[0]
    full = block_size - block_size % 4
    for i in range(acc.shape[0]):
        kv_head = (i % num_heads) // group
        row = acc[i]
        total = np.float32(0.0)
        for t in range(0, full, 4):
            p0, p1, p2, p3 = probs[i, t], probs[i, t + 1], probs[i, t + 2], probs[i, t + 3]
            v0, v1, v2, v3 = values[t, kv_head], values[t + 1, kv_head], \
                values[t + 2, kv_head], values[t + 3, kv_head]
            for d in range(row.shape[0]):
                row[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d])
            total += (p0 + p1) + (p2 + p3)
        for t in range(full, block_size):
            p0, v0 = probs[i, t], values[t, kv_head]
            for d in range(row.shape[0]):
                row[d] += p0 * v0[d]
            total += p0
        row_sum[i] += total


@njit(fastmath=FASTMATH, cache=True)
def exp_rows(probs: np.ndarray, row_max: np.ndarray) -> None:
    """probs[i, t] = exp(probs[i, t] - row_max[i]) in one vectorizable loop per row (a libm
    exp per score does not vectorize): 2^n assembled from its bits, exp(r) by Cephes'
    polynomial. Arguments below -87 (-inf: masked keys) give 0; a row_max of -inf (nothing
    seen yet) counts as 0."""
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
            scale = float_from_bits(np.uint32(np.int32(n) + 127) << np.uint32(23))
            probs[i, t] = p * scale if x > np.float32(-87.0) else np.float32(0.0)

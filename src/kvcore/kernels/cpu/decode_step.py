"""The fused CPU decode step (numba): every decoder layer of a small batch (1-16 query rows) in
one compiled parallel region. Per layer: RMSNorm -> q/k/v (one fused weight) -> rope -> cache
write -> paged attention -> o -> RMSNorm -> gate/up (fused) -> SwiGLU -> down, with the threads
started once for the whole pass and no Python between the ops.

Work sharing: each op's outputs are cut into chunks (a head of q/k/v; an attention work item;
CHUNK_COLS output columns of o, gate/up and down) that the threads claim from an atomic counter
(kvcore.kernels.cpu.sync); a thread waits for the phase's last chunk before the next phase. The
small per-row inputs (a row's norm, its activations quantized for the integer kernels) are
computed by every thread for itself rather than shared behind another barrier. An attention
group (a tile of rows and its key pieces) is merged by the thread that finishes its last piece.

Reduction order: every value is computed by the per-op path's own compiled functions
(layer_rows for norm / rope / SwiGLU, matmul.matmul_rows and quant_gemm.block_rows for the
linear layers, attention's _attend_item and merge_group at the same fixed key pieces), whose
per-row order does not depend on how the outputs are chunked or on which thread runs a chunk:
a row gets the same bits here as on the per-op path, alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from kvcore.kernels.cpu.attention import _attend_item, merge_group
from kvcore.kernels.cpu.attention_blocks import MODE_BF16, MODE_FP16, MODE_FP32
from kvcore.kernels.cpu.layer_rows import rms_norm_row, rope_head, silu_mul_cols
from kvcore.kernels.cpu.matmul import matmul_rows
from kvcore.kernels.cpu.quant_gemm import block_rows, quantize_rows
from kvcore.kernels.cpu.sync import atomic_add, claim, finish, wait_done

CHUNK_COLS = 64  # output columns per chunk of o, gate/up and down (a multiple of the tiles')
PHASES = 5  # per layer: q/k/v, attention, o, gate/up, down
MAX_ROWS = 16  # the largest batch (query rows) the fused step takes


@intrinsic
def _f32_bits_intrinsic(typingctx: object, value: types.Float) -> tuple:
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))
    return sig, codegen


@intrinsic
def _f16_bits_intrinsic(typingctx: object, value: types.Float) -> tuple:
    """IEEE binary16 bits of a float32, rounded to nearest even (as NumPy's astype)."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return sig, codegen


_f32_bits = cast(Callable[[Any], Any], _f32_bits_intrinsic)
_f16_bits = cast(Callable[[Any], Any], _f16_bits_intrinsic)


@njit(inline="always")
def _bf16_bits(value: float) -> Any:
    """bfloat16 bits of a float32, rounded to nearest even (as ml_dtypes' astype)."""
    bits = np.uint32(_f32_bits(np.float32(value)))
    if bits & np.uint32(0x7FFFFFFF) > np.uint32(0x7F800000):  # NaN stays a (quiet) NaN
        return np.uint16((bits >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


def _prepare(weight: object, x: object, a: object, a_scales: object, block_sums: object,
             meta: object) -> None:
    """The rows x as the weight's kernel wants them (quantized for the integer kernels)."""


@overload(_prepare)
def _prepare_impl(weight, x, a, a_scales, block_sums, meta):  # type: ignore[no-untyped-def]
    if weight.dtype == types.float32:
        return lambda weight, x, a, a_scales, block_sums, meta: None

    def impl(weight, x, a, a_scales, block_sums, meta):  # type: ignore[no-untyped-def]
        quantize_rows(x, a, a_scales, block_sums, meta[6] != 0)
    return impl


def _linear(isa: object, weight: object, scales: object, terms: object, meta: object,
            x: object, a: object, a_scales: object, block_sums: object, out: object, n0: int,
            n1: int) -> None:
    """out[:, n0:n1] = x @ weight[n0:n1].T (one layer's weight, as the per-op path)."""


@overload(_linear)
def _linear_impl(isa, weight, scales, terms, meta, x, a, a_scales, block_sums, out, n0,
                 n1):  # type: ignore[no-untyped-def]
    if weight.dtype == types.float32:
        def dense(isa, weight, scales, terms, meta, x, a, a_scales, block_sums, out, n0,
                  n1):  # type: ignore[no-untyped-def]
            matmul_rows(x, weight.reshape(meta[0], meta[1]), out, n0, n1)
        return dense

    def quantized(isa, weight, scales, terms, meta, x, a, a_scales, block_sums, out, n0,
                  n1):  # type: ignore[no-untyped-def]
        if meta[5] == 1:  # q4: the blocks' mins against the activation blocks' sums
            block_rows(isa, a, a_scales, weight, scales, meta[3], meta[4], terms, block_sums,
                       True, out, n0, n1)
        else:  # VNNI's offsets against the activation scales, or no terms
            block_rows(isa, a, a_scales, weight, scales, meta[3], meta[4], terms, a_scales,
                       meta[5] != 0, out, n0, n1)
    return quantized


@njit(inline="always")
def _store_row(cache_f: np.ndarray, cache_b: np.ndarray, mode: int, slot: int, head: int,
               src: np.ndarray, at: int, dim: int, scale: float) -> None:
    """One head's dim values (src[at:]) into cache slot `slot` (divided by scale when not 1)."""
    block_size = cache_f.shape[1] if mode == MODE_FP32 else cache_b.shape[1]
    block, offset = slot // block_size, slot % block_size
    for j in range(dim):
        value = src[at + j]
        if scale != 1.0:
            value = value / np.float32(scale)
        if mode == MODE_FP32:
            cache_f[block, offset, head, j] = value
        elif mode == MODE_FP16:
            cache_b[block, offset, head, j] = _f16_bits(value)
        elif mode == MODE_BF16:
            cache_b[block, offset, head, j] = _bf16_bits(value)


@njit(inline="always")
def _qkv_chunk(c: int, layer: int, isa: np.ndarray, w: tuple, x: np.ndarray, a: np.ndarray,
               a_scales: np.ndarray, block_sums: np.ndarray, dims: np.ndarray,
               positions: np.ndarray, slots: np.ndarray, cos: np.ndarray, sin: np.ndarray,
               qkv_bias: np.ndarray, caches: tuple, cache_mode: int, q_scales: np.ndarray,
               kv_scales: np.ndarray, qkv_out: np.ndarray, q_rot: np.ndarray,
               tmp: np.ndarray) -> None:
    """Head c of q, k or v for every row: its projection, bias, rope, then q scaled for the
    attention, k and v written to their cache slots."""
    heads, kv_heads, dim, rows = dims[1], dims[2], dims[3], dims[5]
    width = qkv_out.shape[1]
    n0 = c * dim
    _linear(isa, w[0][layer], w[1][layer], w[2][layer], w[3], x,
            a, a_scales, block_sums, qkv_out, n0, n0 + dim)
    flat = qkv_out.reshape(qkv_out.size)
    k_f, v_f, k_b, v_b = caches
    f_layer = layer if cache_mode == MODE_FP32 else 0
    b_layer = 0 if cache_mode == MODE_FP32 else layer
    for r in range(rows):
        at = r * width + n0
        if dims[7]:
            for j in range(dim):
                flat[at + j] += qkv_bias[layer, n0 + j]
        if c < heads:
            q_at = (r * heads + c) * dim
            qf = q_rot.reshape(q_rot.size)
            rope_head(flat, at, cos, sin, positions[r], qf, q_at, dim)
            for j in range(dim):
                qf[q_at + j] = qf[q_at + j] * q_scales[layer]
        elif slots[r] >= 0:
            if c < heads + kv_heads:
                rope_head(flat, at, cos, sin, positions[r], tmp, 0, dim)
                _store_row(k_f[f_layer], k_b[b_layer], cache_mode, slots[r], c - heads, tmp, 0,
                           dim, kv_scales[layer, 0])
            else:
                _store_row(v_f[f_layer], v_b[b_layer], cache_mode, slots[r],
                           c - heads - kv_heads, flat, at, dim, kv_scales[layer, 1])


@njit(parallel=True, cache=True)
def run_layers(isa: np.ndarray, h: np.ndarray, positions: np.ndarray, slots: np.ndarray,
               norms: tuple, qkv: tuple, o: tuple, gate_up: tuple, down: tuple,
               biases: tuple, cos: np.ndarray, sin: np.ndarray, caches: tuple,
               cache_mode: int, q_scales: np.ndarray, kv_scales: np.ndarray, attn: tuple,
               dims: np.ndarray, eps: float, scratch: tuple, counters: np.ndarray) -> None:
    """Every layer over the residual rows h (M, hidden), in place; see the module docstring.
    dims: hidden, heads, kv heads, head_dim, intermediate, rows, layers, whether q/k/v and o
    have biases; attn: the batch's
    block tables, context lens, query starts, window, work items, groups, each item's group,
    the int4 placeholders; scratch: per-thread rows (x (T, M, hidden); the quantized
    activations, their scales and block sums for in_features hidden, o's and down's, each
    (T, M, cols); tmp) and the shared outputs (qkv, q, attention, o, gate/up, act, down, the
    partial rows, group counts)."""
    hidden, heads, kv_heads, dim, inter, rows, layers = (dims[0], dims[1], dims[2], dims[3],
                                                         dims[4], dims[5], dims[6])
    xs, tmps = scratch[0], scratch[4]
    in_bufs, o_bufs, down_bufs = scratch[1], scratch[2], scratch[3]
    qkv_out, q_rot, attn_out, o_tmp, gu, act, dn_tmp = (scratch[5], scratch[6], scratch[7],
                                                         scratch[8], scratch[9], scratch[10],
                                                         scratch[11])
    part_max, part_sum, part_out, group_done = scratch[12], scratch[13], scratch[14], scratch[15]
    tables, lens, starts, window, items, groups, item_group, int4 = attn
    k_f, v_f, k_b, v_b = caches
    qkv_bias, o_bias = biases
    num_threads = xs.shape[0]
    num_items, num_groups = items.shape[0], groups.shape[0]
    col_chunks = -(-hidden // CHUNK_COLS)
    inter_chunks = -(-inter // CHUNK_COLS)
    hf = h.reshape(h.size)
    for t in prange(num_threads):
        tmp = tmps[t]
        for layer in range(layers):
            base = layer * PHASES
            # q, k, v: a head per chunk
            x = xs[t]
            a, a_scales, block_sums = in_bufs[0][t], in_bufs[1][t], in_bufs[2][t]
            ready = False
            while True:
                c = claim(counters, base)
                if c >= heads + 2 * kv_heads:
                    break
                if not ready:
                    xf = x.reshape(x.size)
                    for r in range(rows):
                        rms_norm_row(hf, r * hidden, norms[0][layer], eps, xf, r * hidden,
                                     hidden)
                    _prepare(qkv[0], x, a, a_scales, block_sums, qkv[3])
                    ready = True
                _qkv_chunk(c, layer, isa, qkv, x, a, a_scales, block_sums, dims, positions,
                           slots, cos, sin, qkv_bias, caches, cache_mode, q_scales, kv_scales,
                           qkv_out, q_rot, tmp)
                finish(counters, base)
            wait_done(counters, base, heads + 2 * kv_heads)
            # attention: an item per chunk; the last piece of a group merges it
            while True:
                c = claim(counters, base + 1)
                if c >= num_items:
                    break
                fl = layer if cache_mode == MODE_FP32 else 0
                bl = 0 if cache_mode == MODE_FP32 else layer
                _attend_item(q_rot, k_f[fl], v_f[fl], k_b[bl], v_b[bl], cache_mode, int4,
                             tables, lens, starts, window, items[c], part_max, part_sum,
                             part_out)
                g = item_group[c]
                if atomic_add(group_done, layer * num_groups + g, 1) == \
                        groups[g, 3] - groups[g, 2] - 1:
                    merge_group(groups[g], items, part_max, part_sum, part_out,
                                kv_scales[layer, 1], attn_out)
                finish(counters, base + 1)
            wait_done(counters, base + 1, num_items)
            # o, added to the residual
            attn_rows = attn_out.reshape(rows, heads * dim)
            a, a_scales, block_sums = o_bufs[0][t], o_bufs[1][t], o_bufs[2][t]
            ready = False
            while True:
                c = claim(counters, base + 2)
                if c >= col_chunks:
                    break
                if not ready:
                    _prepare(o[0], attn_rows, a, a_scales, block_sums, o[3])
                    ready = True
                n0, n1 = c * CHUNK_COLS, min(hidden, (c + 1) * CHUNK_COLS)
                _linear(isa, o[0][layer], o[1][layer], o[2][layer],
                        o[3], attn_rows, a, a_scales, block_sums, o_tmp, n0, n1)
                for r in range(rows):
                    for n in range(n0, n1):
                        value = o_tmp[r, n]
                        if dims[8]:
                            value = value + o_bias[layer, n]
                        h[r, n] = h[r, n] + value
                finish(counters, base + 2)
            wait_done(counters, base + 2, col_chunks)
            # gate / up and SwiGLU: CHUNK_COLS columns of each per chunk
            a, a_scales, block_sums = in_bufs[0][t], in_bufs[1][t], in_bufs[2][t]
            ready = False
            while True:
                c = claim(counters, base + 3)
                if c >= inter_chunks:
                    break
                if not ready:
                    xf = x.reshape(x.size)
                    for r in range(rows):
                        rms_norm_row(hf, r * hidden, norms[1][layer], eps, xf, r * hidden,
                                     hidden)
                    _prepare(gate_up[0], x, a, a_scales, block_sums, gate_up[3])
                    ready = True
                j0, j1 = c * CHUNK_COLS, min(inter, (c + 1) * CHUNK_COLS)
                terms = gate_up[2][layer]
                for start in (0, inter):
                    _linear(isa, gate_up[0][layer], gate_up[1][layer], terms, gate_up[3], x, a,
                            a_scales, block_sums, gu, start + j0, start + j1)
                gf, af = gu.reshape(gu.size), act.reshape(act.size)
                for r in range(rows):
                    silu_mul_cols(gf, 2 * r * inter + j0, (2 * r + 1) * inter + j0, af,
                                  r * inter + j0, j1 - j0)
                finish(counters, base + 3)
            wait_done(counters, base + 3, inter_chunks)
            # down, added to the residual
            a, a_scales, block_sums = down_bufs[0][t], down_bufs[1][t], down_bufs[2][t]
            ready = False
            while True:
                c = claim(counters, base + 4)
                if c >= col_chunks:
                    break
                if not ready:
                    _prepare(down[0], act, a, a_scales, block_sums, down[3])
                    ready = True
                n0, n1 = c * CHUNK_COLS, min(hidden, (c + 1) * CHUNK_COLS)
                _linear(isa, down[0][layer], down[1][layer],
                        down[2][layer], down[3], act, a,
                        a_scales, block_sums, dn_tmp, n0, n1)
                for r in range(rows):
                    for n in range(n0, n1):
                        h[r, n] = h[r, n] + dn_tmp[r, n]
                finish(counters, base + 4)
            wait_done(counters, base + 4, col_chunks)


def set_threads(threads: int) -> int:
    """numba's threads for this calling thread's regions (at most its pool's size)."""
    threads = max(1, min(threads, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    numba.set_num_threads(threads)
    return threads

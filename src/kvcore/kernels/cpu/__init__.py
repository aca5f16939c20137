"""CPU kernels (NumPy, threaded): the CPU forward pass; the float64 oracles live in tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from kvcore.kernels.cpu import attention_reference, jit, kv_int4, layer_ops
from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.kernels.cpu.layer_ops import rope_cos_sin, rope_inv_freq
from kvcore.kernels.cpu.threads import run_parallel, split

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite e4m3fn value; casts saturate here (as CUDA's __NV_SATFINITE)


def _store(x: np.ndarray, dtype: np.dtype, scale: float) -> np.ndarray:
    """Convert activations to the cache's storage dtype: stored value = x / scale."""
    if dtype == FP8_DTYPE:
        return np.clip(x.astype(np.float32) / np.float32(scale), -FP8_MAX, FP8_MAX).astype(dtype)
    if scale != 1.0:
        x = x / np.float32(scale)
    return x.astype(dtype, copy=False)


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write this step's K/V rows into their cache slots (slot = block_id * block_size + offset).

    key/value (T, Hkv, D); caches (num_blocks, block_size, Hkv, D); slot_mapping (T,), -1 = skip.
    An int4 cache (Int4Layer) takes them into its blocks' fp16 window slots, then seals the
    blocks its `step_seals` name (the rows this step's later query rows read).
    """
    if isinstance(k_cache, Int4Layer):
        assert isinstance(v_cache, Int4Layer)
        kv_int4.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        seals = k_cache.step_seals
        if seals is not None and len(seals):  # what this step's later rows read sealed
            from kvcore.kernels.cpu import kv_int4_blocks

            kv_int4_blocks.seal_blocks(
                k_cache.window.view(np.uint16), v_cache.window.view(np.uint16), k_cache.rows,
                v_cache.rows, np.ascontiguousarray(seals[:, 0]),
                np.ascontiguousarray(seals[:, 1]), v_cache.group)
        return
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value shape {value.shape} differs from key shape {key.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not hold "
                         f"({num_kv_heads}, {head_dim}) heads")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != ({num_tokens},)")
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    if int(slot_mapping.min()) < 0:  # padding slots: keep only the real ones
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
        if slot_mapping.size == 0:
            return
    if int(slot_mapping.max()) >= k_cache.shape[0] * block_size:
        raise ValueError(f"slot {int(slot_mapping.max())} is outside a cache of "
                         f"{k_cache.shape[0]} blocks x {block_size}")
    for cache, rows, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        if cache.flags.c_contiguous:  # slot = row of the (blocks * block_size, Hkv, D) view
            cache.reshape(-1, *cache.shape[2:])[slot_mapping] = _store(rows, cache.dtype, scale)
        else:
            cache[slot_mapping // block_size, slot_mapping % block_size] = _store(
                rows, cache.dtype, scale)


def _check_attention_shapes(query: np.ndarray, k_cache: np.ndarray | Int4Layer,
                            block_tables: np.ndarray, context_lens: np.ndarray,
                            query_start_loc: np.ndarray) -> None:
    """The per-call checks (shapes only, no pass over the arrays); attention_reference.plan
    checks the values of the batch arrays once per new plan."""
    num_seqs = context_lens.shape[0]
    if query.ndim != 3 or len(k_cache.shape) != 4 or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"query {query.shape} and cache {k_cache.shape} shapes do not match")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads "
                         f"({k_cache.shape[2]})")
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc {query_start_loc.shape} / block_tables "
                         f"{block_tables.shape} do not match {num_seqs} sequences")
    if int(query_start_loc[-1]) != query.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])}, "
                         f"query has {query.shape[0]} rows")


def paged_attention(query: np.ndarray, k_cache: np.ndarray | Int4Layer,
                    v_cache: np.ndarray | Int4Layer, block_tables: np.ndarray,
                    context_lens: np.ndarray, query_start_loc: np.ndarray, scale: float,
                    sliding_window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> np.ndarray:
    """Causal attention of a mixed batch (prefill chunks and decode tokens) over the paged cache.

    Query i of sequence s (q_len = qsl[s+1] - qsl[s]) sits at position context_lens[s] - q_len + i
    and attends the keys at positions p' <= p (and p' > p - sliding_window). Returns (T, H, D).
    Runs the compiled kernel (kvcore.kernels.cpu.jit) when numba is there, else NumPy's (the
    reference; its GEMMs make no promise that a row's bits are independent of the batch).
    """
    _check_attention_shapes(query, k_cache, block_tables, context_lens, query_start_loc)
    if jit.supports(query, k_cache, v_cache):
        # every chunk, long or short, and every decode token through the one compiled kernel:
        # its reduction order is per row (a row's bits never depend on the batch or the chunk)
        out = jit.paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                  query_start_loc, scale, sliding_window, k_scale, v_scale)
        return out.astype(query.dtype, copy=False)
    out = _numpy_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                           scale, sliding_window, k_scale, v_scale)
    return out.astype(query.dtype, copy=False)


def _numpy_attention(query: np.ndarray, k_cache: np.ndarray | Int4Layer,
                     v_cache: np.ndarray | Int4Layer, block_tables: np.ndarray,
                     context_lens: np.ndarray, query_start_loc: np.ndarray, scale: float,
                     sliding_window: int | None, k_scale: float, v_scale: float) -> np.ndarray:
    if isinstance(k_cache, Int4Layer):  # each row's blocks in the form its position names
        assert isinstance(v_cache, Int4Layer)
        k_cache, v_cache, block_tables, context_lens, query_start_loc = \
            kv_int4.positional_blocks(k_cache, v_cache, block_tables, context_lens,
                                      query_start_loc)
    assert not isinstance(v_cache, Int4Layer)
    step = attention_reference.plan(block_tables, context_lens, query_start_loc, k_cache.shape[1],
                                    sliding_window)
    return attention_reference.attend(query, k_cache, v_cache, step, scale, sliding_window, k_scale,
                                      v_scale)


def copy_blocks(k_caches: list[np.ndarray], v_caches: list[np.ndarray],
                block_mapping: np.ndarray) -> None:
    """Copy whole blocks src -> dst in every layer; block_mapping (M, 2) int64."""
    if block_mapping.size == 0:
        return
    if block_mapping.ndim != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be (M, 2), got {block_mapping.shape}")
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*k_caches, *v_caches):
        if int(block_mapping.max()) >= cache.shape[0] or int(block_mapping.min()) < 0:
            raise ValueError(f"block_mapping holds a block id outside [0, {cache.shape[0]})")
        cache[dst] = cache[src]


# a thread's share of an element-wise op: at least this many elements (else one thread runs it)
_MIN_SHARE_ELEMENTS = 1 << 16


def _compiled_rows(x: Any) -> bool:
    return isinstance(x, np.ndarray) and jit.active()


def _by_rows(op: Callable[[int, int], None], rows: int, row_elements: int) -> None:
    run_parallel(lambda part: op(part.start, part.stop),
                 split(rows, max(1, _MIN_SHARE_ELEMENTS // max(row_elements, 1))))


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """x / rms(x) * weight over the last axis, float32: compiled row by row
    (kvcore.kernels.cpu.layer_rows, the fused decode step's own function) when numba runs,
    else NumPy's (layer_ops; also the CUDA path's fallback)."""
    if not _compiled_rows(x):
        return layer_ops.rms_norm(x, weight, eps)
    from kvcore.kernels.cpu import layer_rows

    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # (T, n)
    out = np.empty_like(rows)
    w = np.ascontiguousarray(weight, dtype=np.float32)
    _by_rows(lambda r0, r1: layer_rows.rms_norm_rows(rows, w, float(eps), out, r0, r1),
             rows.shape[0], rows.shape[1])
    return out.reshape(x.shape)


def silu_and_mul(x: Any) -> Any:
    """x (T, 2I) = [gate | up] -> silu(gate) * up (T, I): compiled (layer_rows) or NumPy's."""
    if not _compiled_rows(x):
        return layer_ops.silu_and_mul(x)
    from kvcore.kernels.cpu import layer_rows

    rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, x.shape[-1])  # (T, 2I)
    out = np.empty((rows.shape[0], rows.shape[1] // 2), np.float32)
    _by_rows(lambda r0, r1: layer_rows.silu_mul_rows(rows, out, r0, r1), rows.shape[0],
             rows.shape[1])
    return out.reshape(*x.shape[:-1], out.shape[1])


def rope(x: Any, positions: Any, cos: Any, sin: Any) -> Any:
    """Rotate-half rotary embedding of x (T, H, D) at positions (T,): compiled (layer_rows) or
    NumPy's."""
    if not _compiled_rows(x):
        return layer_ops.rope(x, positions, cos, sin)
    from kvcore.kernels.cpu import layer_rows

    rows = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(rows)
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    _by_rows(lambda r0, r1: layer_rows.rope_rows(rows, pos, cos, sin, out, r0, r1),
             rows.shape[0], rows.shape[1] * rows.shape[2])
    return out


__all__ = ["FP8_DTYPE", "FP8_MAX", "copy_blocks", "paged_attention", "reshape_and_cache",
           "rms_norm", "rope", "rope_cos_sin", "rope_inv_freq", "silu_and_mul"]

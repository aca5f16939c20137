"""The CUDA kernels: the GPU implementations behind kvcore.kernels, with the CPU kernels'
signatures (kernels/README.md lists every kernel and the rule that picks it).

kvcore.kernels imports this package only when an argument is a CuPy array; cupy itself is
imported by the first call (cupy_backend), so the planners (attention, attention_kv_int4, mla,
kv_int4) import on machines without it. The .cu / .cuh sources sit beside these modules; `dev`
holds the compile tooling, which the runtime never imports.
"""

from __future__ import annotations

from typing import Any

from kvcore.kernels.cuda.ops import CudaOps

_OPS: CudaOps | None = None


def ops() -> CudaOps:
    global _OPS
    if _OPS is None:
        from kvcore.kernels.cuda.cupy_backend import CupyBackend

        _OPS = CudaOps(CupyBackend())
    return _OPS


def reshape_and_cache(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    ops().reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def reshape_and_cache_int4(key: Any, value: Any, k_window: Any, v_window: Any,
                           window_slot: Any, slot_mapping: Any) -> None:
    ops().reshape_and_cache_int4(key, value, k_window, v_window, window_slot, slot_mapping)


def seal_blocks(k_caches: list[Any], v_caches: list[Any], k_windows: list[Any],
                v_windows: list[Any], pairs: Any, group: int) -> None:
    ops().seal_blocks(k_caches, v_caches, k_windows, v_windows, pairs, group)


def seal_int4_blocks(k_window: Any, v_window: Any, k_rows: Any, v_rows: Any, block_ids: Any,
                     slots: Any, group: int) -> None:
    ops().seal_int4_blocks(k_window, v_window, k_rows, v_rows, block_ids, slots, group)


def paged_attention(query: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any,
                    query_start_loc: Any, scale: float, sliding_window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> Any:
    return ops().paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                 query_start_loc, scale, sliding_window, k_scale, v_scale)


def paged_attention_int4(query: Any, k_cache: Any, v_cache: Any, k_window: Any, v_window: Any,
                         window_slot: Any, block_tables: Any, context_lens: Any,
                         query_start_loc: Any, scale: float, sliding_window: int | None,
                         group: int) -> Any:
    return ops().paged_attention_int4(query, k_cache, v_cache, k_window, v_window, window_slot,
                                      block_tables, context_lens, query_start_loc, scale,
                                      sliding_window, group)


def mla_paged_attention(query: Any, cache: Any, block_tables: Any, context_lens: Any,
                        query_start_loc: Any, kv_lora_rank: int, scale: float,
                        kv_scale: float = 1.0) -> Any:
    return ops().mla_paged_attention(query, cache, block_tables, context_lens, query_start_loc,
                                     kv_lora_rank, scale, kv_scale)


def cache_latent(entries: Any, cache: Any, slot_mapping: Any, scale: float = 1.0) -> None:
    ops().cache_latent(entries, cache, slot_mapping, scale)


def copy_blocks(k_caches: list[Any], v_caches: list[Any], block_mapping: Any) -> None:
    ops().copy_blocks(k_caches, v_caches, block_mapping)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    return ops().rms_norm(x, weight, eps)


def silu_and_mul(x: Any) -> Any:
    return ops().silu_and_mul(x)


def rope(x: Any, positions: Any, cos: Any, sin: Any) -> Any:
    return ops().rope(x, positions, cos, sin)

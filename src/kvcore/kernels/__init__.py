"""Kernels dispatched by array type: NumPy arrays -> `cpu`, CuPy arrays -> `cuda`.

`kvcore.kernels.cuda` is imported lazily, only when an argument is a CuPy array, so the CPU path
never imports cupy. The element-wise ops (rms_norm, silu_and_mul, rope) are written against the
array's own module, so they run on CuPy arrays too where the CUDA module has no dedicated kernel.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from kvcore.device import array_module
from kvcore.kernels import cpu
from kvcore.kernels.cpu import mla
from kvcore.kernels.cpu.jit import warm_up_cpu_kernels


def _on_gpu(array: Any) -> bool:
    return array_module(array).__name__ == "cupy"


def uses_cuda_kernels(array: Any) -> bool:
    """Whether ops on `array` dispatch to kvcore.kernels.cuda (whose kernels want row-major,
    C-contiguous activations)."""
    return _on_gpu(array)


def _cuda() -> ModuleType:
    from kvcore.kernels import cuda  # type: ignore[attr-defined]

    return cuda  # type: ignore[no-any-return]


def reshape_and_cache(key: Any, value: Any, k_cache: Any, v_cache: Any, slot_mapping: Any,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    impl = _cuda() if _on_gpu(key) else cpu
    impl.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: Any, k_cache: Any, v_cache: Any, block_tables: Any, context_lens: Any,
                    query_start_loc: Any, scale: float, sliding_window: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> Any:
    impl = _cuda() if _on_gpu(query) else cpu
    return impl.paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                query_start_loc, scale, sliding_window, k_scale, v_scale)


def mla_paged_attention(query: Any, cache: Any, block_tables: Any, context_lens: Any,
                        query_start_loc: Any, kv_lora_rank: int, scale: float,
                        kv_scale: float = 1.0) -> Any:
    """Absorbed MLA attention over the shared latent cache: (T, H, kv_lora_rank)."""
    impl = _cuda() if _on_gpu(query) else mla
    return impl.mla_paged_attention(query, cache, block_tables, context_lens, query_start_loc,
                                    kv_lora_rank, scale, kv_scale)


def cache_latent(entries: Any, cache: Any, slot_mapping: Any, scale: float = 1.0) -> None:
    """Write (T, 1, W) MLA latent + rope-key rows into their slots of the shared cache."""
    impl = _cuda() if _on_gpu(entries) else mla
    impl.cache_latent(entries, cache, slot_mapping, scale)


def copy_blocks(k_caches: list[Any], v_caches: list[Any], block_mapping: Any) -> None:
    impl = _cuda() if k_caches and _on_gpu(k_caches[0]) else cpu
    impl.copy_blocks(k_caches, v_caches, block_mapping)


def seal_int4_blocks(k_window: Any, v_window: Any, k_rows: Any, v_rows: Any, block_ids: Any,
                     slots: Any, group: int) -> None:
    """Quantize int4 window slots `slots` (fp16 (num_slots, bs, Hkv, D)) into the K and V rows
    of blocks `block_ids` (uint8 (num_blocks, row_bytes)), one layer: kvcore.cache.int4's
    format, bit-exact."""
    if _on_gpu(k_rows):
        _cuda().seal_int4_blocks(k_window, v_window, k_rows, v_rows, block_ids, slots, group)
        return
    from kvcore.kernels.cpu import kv_int4_blocks

    kv_int4_blocks.seal_blocks(k_window.view("uint16"), v_window.view("uint16"), k_rows, v_rows,
                               block_ids, slots, group)


def seal_int4_layers(k_windows: list[Any], v_windows: list[Any], k_rows: list[Any],
                     v_rows: list[Any], pairs: Any, group: int) -> None:
    """seal_int4_blocks in every layer: window slot pairs[m][1] into block pairs[m][0] ((M, 2)
    int64); on cuda one launch for all layers."""
    if k_rows and _on_gpu(k_rows[0]):
        _cuda().seal_blocks(k_rows, v_rows, k_windows, v_windows, pairs, group)
        return
    block_ids, slots = pairs[:, 0].copy(), pairs[:, 1].copy()  # (M,) each, contiguous
    for k_window, v_window, k_row, v_row in zip(k_windows, v_windows, k_rows, v_rows,
                                                strict=True):
        seal_int4_blocks(k_window, v_window, k_row, v_row, block_ids, slots, group)


def _elementwise(name: str, array: Any) -> Any:
    if _on_gpu(array):
        return getattr(_cuda(), name, getattr(cpu, name))
    return getattr(cpu, name)


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    return _elementwise("rms_norm", x)(x, weight, eps)


def silu_and_mul(x: Any) -> Any:
    return _elementwise("silu_and_mul", x)(x)


def rope(x: Any, positions: Any, cos: Any, sin: Any) -> Any:
    return _elementwise("rope", x)(x, positions, cos, sin)


__all__ = ["cache_latent", "copy_blocks", "mla_paged_attention", "paged_attention",
           "reshape_and_cache", "rms_norm", "rope", "seal_int4_blocks", "seal_int4_layers",
           "silu_and_mul", "uses_cuda_kernels", "warm_up_cpu_kernels"]

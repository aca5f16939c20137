"""CUDA kernels through CuPy RawModule: the GPU implementations behind kvcore.kernels.

Imported lazily by kvcore.kernels when an argument is a CuPy array (never on a CPU-only path).
Each .cu source is compiled once per process with `compile_check.nvrtc_options()` (CuPy also
caches the binaries on disk); the functions here have the reference kernels' signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy  # type: ignore[import-not-found]
import numpy as np

from kvcore.kernels.compile_check import KERNEL_DIR, nvrtc_options
from kvcore.kernels.cuda_launch import Kernel
from kvcore.kernels.cuda_ops import CudaOps


class CupyBackend:
    """cuda_ops' backend on a GPU: RawModule kernels, CuPy arrays."""

    xp = cupy

    def __init__(self) -> None:
        self._modules: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._functions: dict[tuple[str, str, tuple[str, ...]], Kernel] = {}
        self._num_sms: int | None = None

    @property
    def smem_opt_in(self) -> int:
        """The most shared memory a block of the current device may opt in to."""
        return int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])

    @property
    def num_sms(self) -> int:
        """The current device's SM count, queried once."""
        if self._num_sms is None:
            self._num_sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        return self._num_sms

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> Kernel:
        """Kernel `name` of `source` compiled with -D`defines` (one module per variant)."""
        kernel = self._functions.get((source, name, defines))
        if kernel is None:
            module = self._modules.get((source, defines))
            if module is None:
                code = (KERNEL_DIR / source).read_text()
                options = (*nvrtc_options(), *(f"-D{d}" for d in defines))
                module = cupy.RawModule(code=code, options=options)
                self._modules[source, defines] = module
            kernel = self._functions[source, name, defines] = module.get_function(name)
            # a kernel asking for more than 48 KB of dynamic shared memory must opt in: allow
            # what the device allows (227 KB on sm_90, 163 KB on sm_80), minus the static part
            kernel.max_dynamic_shared_size_bytes = self.smem_opt_in - kernel.shared_size_bytes
        return kernel

    def pointer_array(self, arrays: Sequence[Any]) -> Any:
        return cupy.asarray(np.array([a.data.ptr for a in arrays], dtype=np.int64))  # (L,)

    def to_host(self, array: Any) -> np.ndarray:
        return cupy.asnumpy(array)  # type: ignore[no-any-return]


_OPS: CudaOps | None = None


def ops() -> CudaOps:
    global _OPS
    if _OPS is None:
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

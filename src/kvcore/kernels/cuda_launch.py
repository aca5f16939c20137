"""Shared pieces of the CUDA launch wrappers: the backend protocol, launches, argument checks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

Kernel = Callable[..., None]  # kernel(grid, block, args, shared_mem=...) as cupy.RawKernel
SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in
_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# CuPy has no bf16 or fp8 dtype: there caches hold the raw bits (uint16 / uint8, see KVCache)
_CACHE_SUFFIX = {**_SUFFIX, "uint16": "bf16", "float8_e4m3fn": "fp8", "uint8": "fp8"}
# (activation, cache) pairs with instantiated kernels
_CACHE_PAIRS = {("f32", "f32"), ("f32", "f16"), ("f32", "bf16"), ("f32", "fp8"),
                ("f16", "f16"), ("f16", "fp8"), ("bf16", "bf16"), ("bf16", "fp8")}


@dataclass(frozen=True, slots=True)
class Launch:
    """One prepared kernel launch; calling it only enqueues the kernel (no host sync)."""

    kernel: Kernel
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int = 0

    def __call__(self) -> None:
        self.kernel(self.grid, self.block, self.args, shared_mem=self.shared_mem)


class Backend(Protocol):
    xp: Any

    @property
    def num_sms(self) -> int:
        """Streaming multiprocessors of the device (split-KV sizing)."""

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> Kernel: ...

    def pointer_array(self, arrays: Sequence[Any]) -> Any: ...

    def to_host(self, array: Any) -> np.ndarray: ...


def suffix_of(name: str, array: Any) -> str:
    suffix = _SUFFIX.get(array.dtype.name)
    if suffix is None:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {array.dtype}")
    return suffix


def cache_suffix_of(name: str, cache: Any, activation_suffix: str) -> str:
    suffix = _CACHE_SUFFIX.get(cache.dtype.name)
    if (activation_suffix, suffix) not in _CACHE_PAIRS:
        raise ValueError(f"{name} dtype {cache.dtype} cannot hold {activation_suffix} "
                         "activations: use the same dtype, fp8 (float8_e4m3fn / uint8), or any "
                         "cache dtype with float32 activations")
    return str(suffix)


def check_contiguous(name: str, array: Any) -> None:
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_int_array(name: str, array: Any, dtype: str,
                    shape: tuple[int, ...] | None = None) -> None:
    if array.dtype.name != dtype:
        raise ValueError(f"{name} must be {dtype}, got {array.dtype}")
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(f"{name} shape {tuple(array.shape)} != {shape}")
    check_contiguous(name, array)

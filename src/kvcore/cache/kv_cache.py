"""The paged KV cache tensors: one K and one V array per layer (or one array that is both, for
multi-head latent attention), plus per-layer fp8 scales."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from kvcore import kernels
from kvcore.device import get_xp, resolve_device

CACHE_DTYPES = ("fp32", "fp16", "bf16", "fp8")


def storage_dtype(dtype: str, device: str) -> np.dtype:
    """The array dtype that holds a cache of `dtype` on `device`.

    CuPy has no bfloat16 or float8 dtype: there the cache holds the raw bits (uint16 / uint8) and
    the CUDA kernels interpret them. NumPy uses ml_dtypes' bfloat16 and float8_e4m3fn.
    """
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
    if dtype == "fp32":
        return np.dtype(np.float32)
    if dtype == "fp16":
        return np.dtype(np.float16)
    if device == "cuda":
        return np.dtype(np.uint16 if dtype == "bf16" else np.uint8)
    return np.dtype(ml_dtypes.bfloat16 if dtype == "bf16" else ml_dtypes.float8_e4m3fn)


class KVCache:
    """K and V arrays (num_blocks, block_size, num_kv_heads, head_dim) for every layer.

    fp8 stores x / scale and reads stored * scale, with one k_scale and one v_scale per layer
    (1.0 unless calibrated scales are given); the other dtypes ignore the scales.

    shared_kv (MLA): one array per layer holds each token's latent and rotated key part, which
    attention reads as both K and V; value_caches is then key_caches (the same arrays) and the
    v_scales are the k_scales.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: str = "fp32", device: str = "cpu",
                 k_scales: Sequence[float] | None = None,
                 v_scales: Sequence[float] | None = None, shared_kv: bool = False) -> None:
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.device = resolve_device(device)
        self.xp = get_xp(self.device)
        # "auto" is the model's compute dtype: kvcore computes in fp32 on both devices
        self.dtype = "fp32" if dtype == "auto" else dtype
        self.storage_dtype = storage_dtype(self.dtype, self.device)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.shared_kv = shared_kv
        if shared_kv and v_scales is not None:
            raise ValueError("v_scales must be None with shared_kv (K and V are one array)")
        self.k_scales = self._scales("k_scales", k_scales)
        self.v_scales = self.k_scales if shared_kv else self._scales("v_scales", v_scales)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zero-filled so padding slots read as finite values, never uninitialized memory
        self.key_caches: list[Any] = [self.xp.zeros(shape, self.storage_dtype)  # one layer
                                      for _ in range(num_layers)]
        self.value_caches: list[Any] = self.key_caches if shared_kv else [
            self.xp.zeros(shape, self.storage_dtype) for _ in range(num_layers)]

    def _scales(self, name: str, scales: Sequence[float] | None) -> list[float]:
        if scales is None:
            return [1.0] * self.num_layers
        values = [float(s) for s in scales]
        if len(values) != self.num_layers or any(not s > 0 for s in values):
            raise ValueError(f"{name} must hold {self.num_layers} positive floats, got {scales!r}")
        return values

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, num_kv_heads, head_dim) of each layer's K (and V) array."""
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def num_bytes(self) -> int:
        """Bytes held by the K and V arrays of all layers (one array per layer if shared)."""
        per_array = self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
        arrays = 1 if self.shared_kv else 2
        return arrays * self.num_layers * per_array * self.storage_dtype.itemsize

    def layer(self, layer_id: int) -> tuple[Any, Any, float, float]:
        """(k_cache, v_cache, k_scale, v_scale) of one layer."""
        return (self.key_caches[layer_id], self.value_caches[layer_id],
                self.k_scales[layer_id], self.v_scales[layer_id])

    def copy_blocks(self, ops: Sequence[tuple[int, int]]) -> None:
        """Execute copy-on-write ops: block src's K/V -> block dst, in every layer."""
        if not ops:
            return
        mapping = np.asarray(ops, dtype=np.int64).reshape(-1, 2)  # (M, 2) src -> dst
        if mapping.min() < 0 or mapping.max() >= self.num_blocks:
            raise ValueError(f"copy ops {list(ops)} name a block outside [0, {self.num_blocks})")
        kernels.copy_blocks(self.key_caches, [] if self.shared_kv else self.value_caches,
                            self.xp.asarray(mapping))

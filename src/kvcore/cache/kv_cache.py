"""The paged KV cache tensors: one K and one V array per layer (or one array that is both, for
multi-head latent attention), plus per-layer fp8 scales; an int4 cache's rows and fp16 window."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from kvcore import kernels
from kvcore.cache import int4
from kvcore.cache.int4_window import SEAL, WindowOp, WindowSlots, batch_window_ops
from kvcore.device import get_xp, resolve_device
from kvcore.kernels.cpu.kv_int4 import Int4Layer

CACHE_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int4")


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
    if dtype == "int4":  # sealed rows of nibbles and fp16 parameters
        return np.dtype(np.uint8)
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

    int4 (kvcore.cache.int4's format): each layer's K and V are rows (num_blocks, row_bytes) of
    sealed blocks, beside an fp16 window (num_window_slots, block_size, Hkv, D) that holds the
    tokens of open blocks, and one window_slot table (num_blocks,) int32 shared by K, V and every
    layer (-1: no slot, the rows hold the block). `window` keeps the host's bookkeeping; the
    steps run its operations (apply_window_ops) before their forward pass, and the forward
    seals `step_seals` after its writes (kvcore.cache.int4_window's rule of positions).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: str = "fp32", device: str = "cpu",
                 k_scales: Sequence[float] | None = None,
                 v_scales: Sequence[float] | None = None, shared_kv: bool = False,
                 num_window_slots: int | None = None, window_tokens: int = 32,
                 int4_group: int = int4.DEFAULT_GROUP) -> None:
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
        self.window: WindowSlots | None = None
        self.key_stack: Any = None
        self.value_stack: Any = None
        if self.dtype == "int4":
            self._init_int4(num_window_slots, window_tokens, int4_group)
            return
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zero-filled so padding slots read as finite values, never uninitialized memory; every
        # layer a view of one (layers, ...) array (the fused CPU decode step reads them all)
        self.key_stack = self.xp.zeros((num_layers, *shape), self.storage_dtype)
        self.value_stack = self.key_stack if shared_kv else self.xp.zeros(
            (num_layers, *shape), self.storage_dtype)
        self.key_caches: list[Any] = list(self.key_stack)  # one layer each
        self.value_caches: list[Any] = self.key_caches if shared_kv else list(self.value_stack)

    def _init_int4(self, num_window_slots: int | None, window_tokens: int, group: int) -> None:
        if self.shared_kv:
            raise ValueError("cache_dtype int4 does not hold a shared (MLA latent) cache")
        group = math.gcd(group, self.head_dim)  # a head narrower than the group: one group
        int4.check_layout(self.block_size, self.head_dim, group)
        if num_window_slots is None or num_window_slots <= 0:
            raise ValueError(f"num_window_slots must be >= 1 for an int4 cache, "
                             f"got {num_window_slots!r}")
        self.int4_group = group
        xp, bs, heads, dim = self.xp, self.block_size, self.num_kv_heads, self.head_dim
        k_bytes = int4.key_row_bytes(bs, heads, dim)
        v_bytes = int4.value_row_bytes(bs, heads, dim, group)
        self.key_caches = [xp.zeros((self.num_blocks, k_bytes), np.uint8)  # one layer's rows
                           for _ in range(self.num_layers)]
        self.value_caches = [xp.zeros((self.num_blocks, v_bytes), np.uint8)
                             for _ in range(self.num_layers)]
        window_shape = (num_window_slots, bs, heads, dim)  # one layer's fp16 window
        self.key_windows: list[Any] = [xp.zeros(window_shape, np.float16)
                                       for _ in range(self.num_layers)]
        self.value_windows: list[Any] = [xp.zeros(window_shape, np.float16)
                                         for _ in range(self.num_layers)]
        self.window_slot = xp.full(self.num_blocks, -1, np.int32)  # (num_blocks,) all layers
        # the CPU kernels seal within a step (the rule of positions); the CUDA kernels read a
        # block in fp16 while it has a slot and seal only before a step
        self.window = WindowSlots(self.num_blocks, num_window_slots, self.block_size,
                                  window_tokens,
                                  seal_in_step=not kernels.uses_cuda_kernels(self.window_slot))
        self.step_seals = np.zeros((0, 2), np.int64)  # (M, 2) this step's (block_id, slot)

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
        """Bytes held by the K and V arrays of all layers (one array per layer if shared); for
        int4 the rows, the fp16 window and the window_slot table."""
        if self.window is not None:
            held = [*self.key_caches, *self.value_caches, *self.key_windows,
                    *self.value_windows, self.window_slot]
            return sum(int(a.nbytes) for a in held)
        per_array = self.num_blocks * self.block_size * self.num_kv_heads * self.head_dim
        arrays = 1 if self.shared_kv else 2
        return arrays * self.num_layers * per_array * self.storage_dtype.itemsize

    def layer(self, layer_id: int) -> tuple[Any, Any, float, float]:
        """(k_cache, v_cache, k_scale, v_scale) of one layer; int4: two Int4Layers."""
        if self.window is not None:
            slots, group = self.window_slot, self.int4_group
            blocks, seals = self.window.window_blocks, self.step_seals
            return (Int4Layer(self.key_caches[layer_id], self.key_windows[layer_id], slots, True,
                              group, blocks, seals),
                    Int4Layer(self.value_caches[layer_id], self.value_windows[layer_id], slots,
                              False, group, blocks, seals), 1.0, 1.0)
        return (self.key_caches[layer_id], self.value_caches[layer_id],
                self.k_scales[layer_id], self.v_scales[layer_id])

    def copy_blocks(self, ops: Sequence[tuple[int, int]]) -> None:
        """Execute copy-on-write ops: block src's K/V -> block dst, in every layer. int4: none
        to run, a copied block is always open (WindowSlots.copy): the window operations copy
        its tokens, and its rows are stale until it is sealed."""
        if not ops or self.window is not None:
            return
        mapping = np.asarray(ops, dtype=np.int64).reshape(-1, 2)  # (M, 2) src -> dst
        if mapping.min() < 0 or mapping.max() >= self.num_blocks:
            raise ValueError(f"copy ops {list(ops)} name a block outside [0, {self.num_blocks})")
        kernels.copy_blocks(self.key_caches, [] if self.shared_kv else self.value_caches,
                            self.xp.asarray(mapping))

    def take_window_ops(self) -> list[WindowOp] | None:
        """An int4 cache's window operations for the step being launched (see WindowSlots);
        None for the other dtypes. Called once per step, where the step is built; every step
        of an int4 cache applies its list (apply_window_ops), even an empty one."""
        return None if self.window is None else self.window.take_ops()

    def apply_window_ops(self, ops: Sequence[WindowOp]) -> None:
        """Run a step's window operations in order, before its forward pass: slot
        assignments, copies (of the fp16 window, every layer), seals (each block's slot
        quantized into its rows, every layer) and releases; its in-step seals become
        `step_seals`, which the forward runs after its writes (kvcore.kernels.cpu). Batched
        (int4_window.batch_window_ops): one launch per run of seals or copies and one write of
        the window_slot table, however many operations (on cuda: few small copies)."""
        stages, table, step_seals = batch_window_ops(ops)
        self.step_seals = np.array(step_seals, np.int64).reshape(-1, 2)  # (M, 2)
        for kind, pairs in stages:
            # host pairs: the CUDA wrappers check them on the host before they upload them
            mapping = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)  # (M, 2)
            if kind == SEAL:  # (block_id, slot)
                kernels.seal_int4_layers(self.key_windows, self.value_windows, self.key_caches,
                                         self.value_caches, mapping, self.int4_group)
            else:  # (src slot, dst slot)
                kernels.copy_blocks(self.key_windows, self.value_windows, mapping)
        if table:
            update = self.xp.asarray(np.array([list(table), list(table.values())],
                                              np.int32))  # (2, N) one copy to the device
            self.window_slot[update[0]] = update[1]

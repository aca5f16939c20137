"""CUDA kernel wrappers: argument checks, grids and launches for every kernel.

`CudaOps(backend)` is written against a small backend (array module, kernel lookup, pointer
tables, host copies) so the same code drives CuPy on a GPU (kvcore.kernels.cuda) and the CPU
emulation harness of the tests. Every wrapper checks dtype, shape and contiguity before it
launches and raises ValueError naming the argument.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.kernels.cuda.attention import plan_paged_attention
from kvcore.kernels.cuda.attention_kv_int4 import plan_int4_attention
from kvcore.kernels.cuda.kv_int4 import Int4LayerLike, int4_write_launch, seal_launch
from kvcore.kernels.cuda.launch import (
    Backend,
    cache_suffix_of,
    check_contiguous,
    check_int_array,
    suffix_of,
)
from kvcore.kernels.cuda.mla import plan_mla_attention
from kvcore.kernels.cuda.occupancy import PARTITION_TOKENS


class CudaOps:
    """The kernels' wrappers over one backend; methods mirror kvcore.kernels.cpu."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.xp = backend.xp

    def reshape_and_cache(self, key: Any, value: Any, k_cache: Any, v_cache: Any,
                          slot_mapping: Any, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        if isinstance(k_cache, Int4LayerLike):  # an int4 layer: the rows go to its window
            self.reshape_and_cache_int4(key, value, k_cache.window, v_cache.window,
                                        k_cache.window_slot, slot_mapping)
            return
        if key.ndim != 3 or value.shape != key.shape:
            raise ValueError(f"key {key.shape} / value {value.shape} must be equal (T, Hkv, D)")
        num_tokens, num_kv_heads, head_dim = key.shape
        if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or \
                tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(f"k_cache {k_cache.shape} / v_cache {v_cache.shape} must be equal "
                             f"(num_blocks, block_size, {num_kv_heads}, {head_dim})")
        if value.dtype != key.dtype or v_cache.dtype != k_cache.dtype:
            raise ValueError("key/value and k_cache/v_cache must share their dtypes")
        suffix = suffix_of("key", key)
        cache_suffix = cache_suffix_of("k_cache", k_cache, suffix)
        if isinstance(slot_mapping, np.ndarray) and slot_mapping.size:
            # host slots are checked; device slots are trusted (reading them back would sync)
            limit = k_cache.shape[0] * k_cache.shape[1]
            if int(slot_mapping.max()) >= limit or int(slot_mapping.min()) < -1:
                raise ValueError(f"slot_mapping holds a slot outside [-1, {limit})")
        slot_mapping = self.xp.asarray(slot_mapping)
        check_int_array("slot_mapping", slot_mapping, "int64", (num_tokens,))
        for name, array in (("key", key), ("value", value), ("k_cache", k_cache),
                            ("v_cache", v_cache)):
            check_contiguous(name, array)
        if num_tokens == 0:
            return
        kernel = self.backend.function("cache_ops.cu", f"reshape_and_cache_{suffix}_{cache_suffix}")
        kernel((num_tokens,), (128,), (key, value, k_cache, v_cache, slot_mapping,
                                       np.int32(num_kv_heads * head_dim), np.float32(k_scale),
                                       np.float32(v_scale)))

    def reshape_and_cache_int4(self, key: Any, value: Any, k_window: Any, v_window: Any,
                               window_slot: Any, slot_mapping: Any) -> None:
        """An int4 cache's write: the rows into their blocks' fp16 window slots."""
        launch = int4_write_launch(self.backend, key, value, k_window, v_window, window_slot,
                                   slot_mapping)
        if launch is not None:
            launch()

    def seal_blocks(self, k_caches: list[Any], v_caches: list[Any], k_windows: list[Any],
                    v_windows: list[Any], pairs: Any, group: int) -> None:
        """Quantize window slot pairs[m][1] into int4 block pairs[m][0] in every layer."""
        launch = seal_launch(self.backend, k_caches, v_caches, k_windows, v_windows, pairs,
                             group)
        if launch is not None:
            launch()

    def seal_int4_blocks(self, k_window: Any, v_window: Any, k_rows: Any, v_rows: Any,
                         block_ids: Any, slots: Any, group: int) -> None:
        """One layer's seal as kvcore.kernels.seal_int4_blocks calls it: window slot slots[i]
        into block block_ids[i]."""
        block_ids, slots = (np.asarray(self.backend.to_host(a)).reshape(-1)
                            for a in (block_ids, slots))
        if block_ids.shape != slots.shape:
            raise ValueError(f"block_ids {block_ids.shape} and slots {slots.shape} must pair up")
        self.seal_blocks([k_rows], [v_rows], [k_window], [v_window],
                         np.stack([block_ids, slots], axis=1), group)

    def copy_blocks(self, k_caches: list[Any], v_caches: list[Any], block_mapping: Any) -> None:
        mapping = np.asarray(self.backend.to_host(block_mapping))
        if mapping.size == 0:
            return
        if not v_caches:  # shared K/V (MLA): the kernel copies each block of the one array twice
            v_caches = k_caches
        if mapping.ndim != 2 or mapping.shape[1] != 2:
            raise ValueError(f"block_mapping must be (M, 2), got {mapping.shape}")
        if not k_caches or len(k_caches) != len(v_caches):
            raise ValueError(f"k_caches ({len(k_caches)}) and v_caches ({len(v_caches)}) must "
                             "be non-empty lists of equal length")
        shape, dtype = k_caches[0].shape, k_caches[0].dtype
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            for i, cache in enumerate(caches):
                if cache.shape != shape or cache.dtype != dtype:
                    raise ValueError(f"{name}[{i}] is {cache.shape} {cache.dtype}, "
                                     f"expected {shape} {dtype}")
                check_contiguous(f"{name}[{i}]", cache)
        if mapping.min() < 0 or mapping.max() >= shape[0]:
            raise ValueError(f"block_mapping holds a block id outside [0, {shape[0]})")
        src, dst = mapping[:, 0], mapping[:, 1]
        # parallel blocks copy at once: a destination that is also a source would race
        if len(set(dst.tolist())) != len(dst) or set(dst.tolist()) & set(src.tolist()):
            raise ValueError("block_mapping destinations must be distinct and never a source")
        bytes_per_block = int(np.prod(shape[1:])) * dtype.itemsize
        mapping_dev = self.xp.asarray(np.ascontiguousarray(mapping, dtype=np.int64))
        kernel = self.backend.function("cache_ops.cu", "copy_blocks")
        kernel((len(k_caches), len(mapping)), (256,),
               (self.backend.pointer_array(k_caches), self.backend.pointer_array(v_caches),
                mapping_dev, np.int64(bytes_per_block)))
    def paged_attention(self, query: Any, k_cache: Any, v_cache: Any, block_tables: Any,
                        context_lens: Any, query_start_loc: Any, scale: float,
                        sliding_window: int | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0, *, partition_tokens: int = PARTITION_TOKENS,
                        host_metadata: bool | None = None) -> Any:
        if isinstance(k_cache, Int4LayerLike):  # an int4 layer carries its own scales
            if k_scale != 1.0 or v_scale != 1.0:
                raise ValueError(f"an int4 cache takes no k_scale / v_scale, got {k_scale} / "
                                 f"{v_scale}")
            return self.paged_attention_int4(
                query, k_cache.rows, v_cache.rows, k_cache.window, v_cache.window,
                k_cache.window_slot, block_tables, context_lens, query_start_loc, scale,
                sliding_window, v_cache.group, partition_tokens=partition_tokens,
                host_metadata=host_metadata)
        out, launches = plan_paged_attention(
            self.backend, query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
            scale, sliding_window, k_scale, v_scale, partition_tokens=partition_tokens,
            host_metadata=host_metadata)
        for launch in launches:
            launch()
        return out

    def paged_attention_int4(self, query: Any, k_cache: Any, v_cache: Any, k_window: Any,
                             v_window: Any, window_slot: Any, block_tables: Any,
                             context_lens: Any, query_start_loc: Any, scale: float,
                             sliding_window: int | None, group: int, *,
                             partition_tokens: int = PARTITION_TOKENS,
                             host_metadata: bool | None = None) -> Any:
        """paged_attention over an int4 cache (sealed int4 rows + fp16 window): (T, H, D)."""
        out, launches = plan_int4_attention(
            self.backend, query, k_cache, v_cache, k_window, v_window, window_slot,
            block_tables, context_lens, query_start_loc, scale, sliding_window, group,
            partition_tokens=partition_tokens, host_metadata=host_metadata)
        for launch in launches:
            launch()
        return out

    def cache_latent(self, entries: Any, cache: Any, slot_mapping: Any,
                     scale: float = 1.0) -> None:
        """MLA: write (T, 1, W) latent + rope-key rows into the shared cache (the K/V write
        with both sides the same array and rows)."""
        self.reshape_and_cache(entries, entries, cache, cache, slot_mapping, scale, scale)

    def mla_paged_attention(self, query: Any, cache: Any, block_tables: Any, context_lens: Any,
                            query_start_loc: Any, kv_lora_rank: int, scale: float,
                            kv_scale: float = 1.0, *, num_partitions: int | None = None,
                            host_metadata: bool | None = None) -> Any:
        """Absorbed MLA attention over the latent cache: (T, H, kv_lora_rank)."""
        out, launches = plan_mla_attention(
            self.backend, query, cache, block_tables, context_lens, query_start_loc,
            kv_lora_rank, scale, kv_scale, num_partitions=num_partitions,
            host_metadata=host_metadata)
        for launch in launches:
            launch()
        return out

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        suffix = suffix_of("x", x)
        if x.ndim != 2 or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
            raise ValueError(f"x {x.shape} {x.dtype} must be (T, hidden) and weight "
                             f"{weight.shape} {weight.dtype} (hidden,) of the same dtype")
        check_contiguous("x", x)
        check_contiguous("weight", weight)
        out = self.xp.empty(x.shape, dtype=x.dtype)  # (T, hidden)
        if x.shape[0]:
            self.backend.function("layers.cu", f"rms_norm_{suffix}")(
                (x.shape[0],), (256,), (out, x, weight, np.float32(eps), np.int32(x.shape[1])))
        return out

    def silu_and_mul(self, x: Any) -> Any:
        suffix = suffix_of("x", x)
        if x.ndim != 2 or x.shape[1] % 2:
            raise ValueError(f"x must be (T, 2 * intermediate), got {x.shape}")
        check_contiguous("x", x)
        inter = x.shape[1] // 2
        out = self.xp.empty((x.shape[0], inter), dtype=x.dtype)  # (T, I)
        if x.shape[0]:
            self.backend.function("layers.cu", f"silu_and_mul_{suffix}")(
                (x.shape[0],), (256,), (out, x, np.int32(inter)))
        return out

    def rope(self, x: Any, positions: Any, cos: Any, sin: Any) -> Any:
        suffix = suffix_of("x", x)
        if x.ndim != 3 or x.shape[2] % 2:
            raise ValueError(f"x must be (T, H, D) with D even, got {x.shape}")
        num_tokens, num_heads, head_dim = x.shape
        positions = self.xp.asarray(positions)
        check_int_array("positions", positions, "int64", (num_tokens,))
        for name, table in (("cos", cos), ("sin", sin)):
            if table.dtype.name != "float32" or table.ndim != 2 or table.shape[1] != head_dim // 2:
                raise ValueError(f"{name} must be float32 (max_pos, {head_dim // 2}), got "
                                 f"{table.shape} {table.dtype}")
            check_contiguous(name, table)
        item = x.dtype.itemsize
        # tokens may be strided (a column slice of the fused qkv output); (H, D) must be dense
        if tuple(x.strides[1:]) != (head_dim * item, item) or x.strides[0] % item:
            raise ValueError(f"x must be contiguous within each token, got strides {x.strides}")
        out = self.xp.empty(x.shape, dtype=x.dtype)  # (T, H, D)
        if num_tokens:
            self.backend.function("layers.cu", f"rope_{suffix}")(
                (num_tokens,), (128,), (out, x, positions, cos, sin, np.int32(num_heads),
                                        np.int32(head_dim), np.int64(x.strides[0] // item)))
        return out

"""The int4 KV cache on CUDA: checks and launches of the window write, the seal of window slots
into int4 blocks, and paged attention over sealed int4 blocks and fp16 window blocks.

The byte layout is kvcore.cache.int4's (this layer sits below kvcore.cache, so the two row sizes
are restated here and the tests hold them equal). Per layer: k_cache (num_blocks, key row bytes)
and v_cache (num_blocks, value row bytes) uint8, k_window / v_window (num_slots, block_size, Hkv,
head_dim) float16, and window_slot (num_blocks,) int32: -1 = sealed, else the window slot
holding the block's fp16 tokens.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvcore.kernels.cuda.launch import (
    Backend,
    Launch,
    check_contiguous,
    check_int_array,
    suffix_of,
)

INT4_MIN_BLOCK_SIZE = 8  # the attention kernels stage the K params of 64 / 8 + 1 blocks per tile


@runtime_checkable
class Int4LayerLike(Protocol):
    """K or V of one int4 cache layer as the engine hands it to the kernels (the CPU path's
    kernels.cpu.kv_int4.Int4Layer): sealed rows, the fp16 window, the shared window_slot table."""

    rows: Any  # (num_blocks, row bytes) uint8
    window: Any  # (num_slots, block_size, Hkv, head_dim) float16
    window_slot: Any  # (num_blocks,) int32
    group: int  # value channels per scale


def key_row_bytes(block_size: int, heads: int, head_dim: int) -> int:
    """Bytes of one sealed K block: nibbles, then per-channel (scale, zero) fp16."""
    return block_size * heads * head_dim // 2 + 4 * heads * head_dim


def value_row_bytes(block_size: int, heads: int, head_dim: int, group: int) -> int:
    """Bytes of one sealed V block: nibbles, then per-token, per-group (scale, zero) fp16."""
    return block_size * heads * head_dim // 2 + 4 * block_size * heads * (head_dim // group)


def check_int4_cache(k_cache: Any, v_cache: Any, k_window: Any, v_window: Any,
                     window_slot: Any | None, group: int) -> tuple[int, int, int]:
    """Shapes, dtypes and contiguity of one layer's int4 cache (window_slot None: not
    checked); (block_size, Hkv, head_dim)."""
    if k_window.ndim != 4 or k_window.shape != v_window.shape or \
            k_window.dtype.name != "float16" or v_window.dtype.name != "float16":
        raise ValueError(f"k_window {k_window.shape} {k_window.dtype} / v_window "
                         f"{v_window.shape} {v_window.dtype} must be equal float16 "
                         "(num_slots, block_size, Hkv, head_dim)")
    _, block_size, heads, head_dim = k_window.shape
    if group <= 0 or head_dim % group or group % 8:
        raise ValueError(f"int4 group must be a multiple of 8 dividing head_dim {head_dim}, "
                         f"got {group}")
    num_blocks = k_cache.shape[0] if k_cache.ndim == 2 else -1
    rows = (key_row_bytes(block_size, heads, head_dim),
            value_row_bytes(block_size, heads, head_dim, group))
    for name, cache, row in (("k_cache", k_cache, rows[0]), ("v_cache", v_cache, rows[1])):
        if cache.dtype.name != "uint8" or tuple(cache.shape) != (num_blocks, row):
            raise ValueError(f"{name} must be uint8 ({num_blocks}, {row}) for block_size "
                             f"{block_size}, {heads} KV heads, head_dim {head_dim}, group "
                             f"{group}; got {cache.shape} {cache.dtype}")
    if window_slot is not None:
        check_int_array("window_slot", window_slot, "int32", (num_blocks,))
    for name, array in (("k_cache", k_cache), ("v_cache", v_cache), ("k_window", k_window),
                        ("v_window", v_window)):
        check_contiguous(name, array)
    return block_size, heads, head_dim


def int4_write_launch(backend: Backend, key: Any, value: Any, k_window: Any, v_window: Any,
                      window_slot: Any, slot_mapping: Any) -> Launch | None:
    """reshape_and_cache for an int4 cache: the (T, Hkv, D) rows into the fp16 window slot of
    each slot's block (slot_mapping int64, -1 = padding). Host slots into a sealed block (or out
    of range) raise; device ones are trusted (the kernel skips sealed blocks)."""
    suffix = suffix_of("key", key)
    if key.ndim != 3 or value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"key {key.shape} / value {value.shape} must be equal (T, Hkv, D)")
    if k_window.ndim != 4 or k_window.shape != v_window.shape or \
            tuple(k_window.shape[2:]) != tuple(key.shape[1:]) or \
            k_window.dtype.name != "float16" or v_window.dtype.name != "float16":
        raise ValueError(f"k_window {k_window.shape} / v_window {v_window.shape} must be equal "
                         f"float16 (num_slots, block_size, {key.shape[1]}, {key.shape[2]})")
    num_tokens, block_size = key.shape[0], k_window.shape[1]
    if window_slot.ndim != 1:
        raise ValueError(f"window_slot must be (num_blocks,), got {window_slot.shape}")
    if isinstance(slot_mapping, np.ndarray) and isinstance(window_slot, np.ndarray) and \
            slot_mapping.size:
        live = slot_mapping[slot_mapping >= 0]
        limit = window_slot.shape[0] * block_size
        if int(slot_mapping.min()) < -1 or (live.size and int(live.max()) >= limit):
            raise ValueError(f"slot_mapping holds a slot outside [-1, {limit})")
        if np.any(window_slot[live // block_size] < 0):
            raise ValueError("slot_mapping writes into a sealed int4 block (window_slot -1)")
    slot_mapping = backend.xp.asarray(slot_mapping)
    window_slot = backend.xp.asarray(window_slot)
    check_int_array("slot_mapping", slot_mapping, "int64", (num_tokens,))
    check_int_array("window_slot", window_slot, "int32")
    for name, array in (("key", key), ("value", value), ("k_window", k_window),
                        ("v_window", v_window)):
        check_contiguous(name, array)
    if num_tokens == 0:
        return None
    return Launch(backend.function("kv_int4_cache.cu", f"reshape_and_cache_int4_{suffix}"),
                  (num_tokens,), (128,),
                  (key, value, k_window, v_window, window_slot, slot_mapping,
                   np.int32(block_size), np.int32(key.shape[1] * key.shape[2])))


def seal_launch(backend: Backend, k_caches: list[Any], v_caches: list[Any],
                k_windows: list[Any], v_windows: list[Any], pairs: Any,
                group: int) -> Launch | None:
    """One launch quantizing, in every layer, window slot pairs[m][1] into block pairs[m][0]
    (bit-exactly kvcore.cache.int4's quantize_key_block / quantize_value_block). The window
    slots are left as they are; setting window_slot to -1 is the caller's."""
    pairs = np.asarray(backend.to_host(pairs))
    if pairs.size == 0:
        return None
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype.kind not in "iu":
        raise ValueError(f"pairs must be integer (M, 2) (block_id, window slot), got "
                         f"{pairs.shape} {pairs.dtype}")
    layers = len(k_caches)
    if not layers or not len(v_caches) == len(k_windows) == len(v_windows) == layers:
        raise ValueError("k_caches, v_caches, k_windows and v_windows must be non-empty lists "
                         "of one array per layer")
    block_size, heads, head_dim = check_int4_cache(k_caches[0], v_caches[0], k_windows[0],
                                                   v_windows[0], None, group)
    for i in range(1, layers):
        layout = check_int4_cache(k_caches[i], v_caches[i], k_windows[i], v_windows[i], None,
                                  group)
        if layout != (block_size, heads, head_dim) or k_caches[i].shape != k_caches[0].shape \
                or k_windows[i].shape != k_windows[0].shape:
            raise ValueError(f"layer {i}'s int4 cache differs in shape from layer 0's")
    num_blocks, num_slots = k_caches[0].shape[0], k_windows[0].shape[0]
    blocks, slots = pairs[:, 0], pairs[:, 1]
    if blocks.min() < 0 or blocks.max() >= num_blocks or slots.min() < 0 or \
            slots.max() >= num_slots:
        raise ValueError(f"pairs hold a block outside [0, {num_blocks}) or a window slot "
                         f"outside [0, {num_slots})")
    if len(set(blocks.tolist())) != len(blocks):
        raise ValueError("pairs must seal each block at most once")
    smem = block_size * head_dim * 5  # the slot's head as floats, and its codes
    return Launch(backend.function("kv_int4_cache.cu", "seal_blocks_int4"),
                  (len(pairs), heads, layers), (128,),
                  (*(backend.pointer_array(a) for a in (k_caches, v_caches, k_windows,
                                                        v_windows)),
                   backend.xp.asarray(np.ascontiguousarray(pairs, dtype=np.int64)),
                   np.int32(block_size), np.int32(heads), np.int32(head_dim), np.int32(group),
                   np.int64(key_row_bytes(block_size, heads, head_dim)),
                   np.int64(value_row_bytes(block_size, heads, head_dim, group))),
                  smem)

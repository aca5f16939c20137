"""One layer of an int4 KV cache as the kernels see it, and its NumPy operations: writing
tokens into the fp16 window, and reading blocks back as float32 (sealed rows dequantized,
window blocks widened) for the NumPy attention.

A block is either sealed (window_slot[block_id] == -1: its K and V rows hold the int4 format of
kvcore.kernels.int4_numba) or open (its tokens in fp16 in window slot window_slot[block_id]).
Writes go to open blocks only; the cache layer seals a block once no draft can roll it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Int4Layer:
    """K or V of one layer: sealed rows, the fp16 window, and the table shared by K, V and
    every layer saying where each block lives."""

    rows: Any  # (num_blocks, row_bytes) uint8
    window: Any  # (num_slots, block_size, num_kv_heads, head_dim) float16
    window_slot: Any  # (num_blocks,) int32: -1 sealed, else the block's window slot
    is_key: bool
    group: int  # value channels per scale (V rows)

    @property
    def block_size(self) -> int:
        return int(self.window.shape[1])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, num_kv_heads, head_dim), as a 16-bit cache's shape."""
        _, bs, heads, dim = self.window.shape
        return (int(self.rows.shape[0]), int(bs), int(heads), int(dim))


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_layer: Int4Layer,
                      v_layer: Int4Layer, slot_mapping: np.ndarray) -> None:
    """Write this step's K/V rows (T, Hkv, D) into the window slots of their blocks
    (slot = block_id * block_size + offset; -1 = skip). ValueError for a sealed block."""
    num_blocks, block_size, heads, dim = k_layer.shape
    if value.shape != key.shape or key.shape[1:] != (heads, dim):
        raise ValueError(f"key {key.shape} / value {value.shape} do not hold ({heads}, {dim}) "
                         f"heads")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != ({key.shape[0]},)")
    valid = slot_mapping >= 0
    if not valid.all():
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    if slot_mapping.size == 0:
        return
    if int(slot_mapping.max()) >= num_blocks * block_size:
        raise ValueError(f"slot {int(slot_mapping.max())} is outside a cache of {num_blocks} "
                         f"blocks x {block_size}")
    blocks = slot_mapping // block_size
    window_slots = k_layer.window_slot[blocks]  # (T,)
    if int(window_slots.min()) < 0:
        sealed = int(blocks[np.argmin(window_slots)])
        raise ValueError(f"block {sealed} is sealed (int4): a write needs an open window slot")
    offsets = slot_mapping % block_size
    k_layer.window[window_slots, offsets] = key
    v_layer.window[window_slots, offsets] = value


def _unpack(nibbles: np.ndarray) -> np.ndarray:
    out = np.empty(nibbles.shape[:-1] + (nibbles.shape[-1] * 2,), np.float32)
    out[..., 0::2], out[..., 1::2] = nibbles & 0xF, nibbles >> 4
    return out


def _params(rows: np.ndarray, start: int, shape: tuple[int, ...]) -> np.ndarray:
    """fp16 parameters stored from byte `start` of each row, as float32 (n, *shape)."""
    count = int(np.prod(shape))
    raw = np.ascontiguousarray(rows[:, start:start + 2 * count])
    return raw.view(np.float16).astype(np.float32).reshape(rows.shape[0], *shape)


def dequantize(layer: Int4Layer, block_ids: np.ndarray) -> np.ndarray:
    """Blocks block_ids (n,) as float32 (n, block_size, Hkv, D): sealed ones dequantized from
    their rows, open ones read from their window slots."""
    _, bs, heads, dim = layer.shape
    split = bs * heads * dim // 2
    rows = layer.rows[block_ids]  # (n, row_bytes)
    q = _unpack(rows[:, :split].reshape(-1, bs, heads, dim // 2))  # (n, bs, Hkv, D)
    with np.errstate(invalid="ignore", over="ignore"):  # an open block's stale row: replaced
        out = _decode(layer, rows, q, split)
    slots = layer.window_slot[block_ids]
    open_blocks = slots >= 0
    if open_blocks.any():
        out[open_blocks] = layer.window[slots[open_blocks]]
    return out


def _decode(layer: Int4Layer, rows: np.ndarray, q: np.ndarray, split: int) -> np.ndarray:
    """zero + scale * q of sealed rows (n, row_bytes) with codes q (n, bs, Hkv, D)."""
    _, bs, heads, dim = layer.shape
    if layer.is_key:
        params = _params(rows, split, (2, 1, heads, dim))  # per channel
        return params[:, 1] + params[:, 0] * q  # type: ignore[no-any-return]
    groups = dim // layer.group
    params = _params(rows, split, (2, bs, heads, groups, 1))  # per token and group
    grouped = q.reshape(-1, bs, heads, groups, layer.group)
    return (params[:, 1] + params[:, 0] * grouped).reshape(-1, bs, heads, dim)


def dense_blocks(k_layer: Int4Layer, v_layer: Int4Layer, block_tables: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(K, V, tables): the blocks the batch's tables name, as compact float32 caches (n, bs,
    Hkv, D), and the tables renumbered into them (-1 and other negatives kept)."""
    named = block_tables >= 0
    block_ids = np.unique(block_tables[named])  # (n,)
    if block_ids.size and int(block_ids[-1]) >= k_layer.rows.shape[0]:
        raise ValueError(f"block_tables holds block {int(block_ids[-1])}, outside the cache "
                         f"({k_layer.rows.shape[0]} blocks)")
    tables = np.where(named, np.searchsorted(block_ids, np.maximum(block_tables, 0)),
                      block_tables).astype(np.int32)
    if block_ids.size == 0:  # nothing to read: one zero block keeps the shapes valid
        shape = (1, *k_layer.shape[1:])
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32), tables
    return dequantize(k_layer, block_ids), dequantize(v_layer, block_ids), tables

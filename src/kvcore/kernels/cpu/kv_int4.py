"""One layer of an int4 KV cache as the kernels see it, and its NumPy operations: writing
tokens into the fp16 window, and reading blocks back as float32 for the NumPy attention, each
in the form the rule of positions names (kvcore.cache.int4_window).

A block's tokens are in fp16 in window slot window_slot[block_id] while it holds one (-1: none),
its rows hold the int4 format of kvcore.kernels.cpu.kv_int4_blocks once it is sealed. A query
row reads the blocks of its own super-block (window_blocks blocks) from their slots and every
earlier block from its rows; the cache layer keeps both valid where the rule reads them.
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
    window_slot: Any  # (num_blocks,) int32: -1 no slot (rows only), else the block's slot
    is_key: bool
    group: int  # value channels per scale (V rows)
    # blocks per super-block: a query row reads its own super-block's blocks from their
    # window slots and every earlier block from its rows (kvcore.cache.int4_window)
    window_blocks: int = 1
    # (M, 2) int64 (block_id, slot): sealed by this step after its writes (CPU path), so its
    # later rows read them sealed; None or empty: none
    step_seals: Any = None

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


def _sealed(layer: Int4Layer, block_ids: np.ndarray) -> np.ndarray:
    """Blocks block_ids (n,) dequantized from their rows, float32 (n, block_size, Hkv, D)."""
    _, bs, heads, dim = layer.shape
    split = bs * heads * dim // 2
    rows = layer.rows[block_ids]  # (n, row_bytes)
    q = _unpack(rows[:, :split].reshape(-1, bs, heads, dim // 2))  # (n, bs, Hkv, D)
    with np.errstate(invalid="ignore", over="ignore"):  # a row never sealed: never read
        return _decode(layer, rows, q, split)


def _widened(layer: Int4Layer, block_ids: np.ndarray) -> np.ndarray:
    """Blocks block_ids (n,) read from their window slots, float32 (n, block_size, Hkv, D);
    zeros for a block without a slot (never read)."""
    slots = layer.window_slot[block_ids]
    out = np.zeros((len(block_ids), *layer.shape[1:]), np.float32)
    held = slots >= 0
    out[held] = layer.window[slots[held]]
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


def positional_blocks(k_layer: Int4Layer, v_layer: Int4Layer, block_tables: np.ndarray,
                      context_lens: np.ndarray, query_start_loc: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The batch as the NumPy attention can read it under the rule of positions: (K, V,
    tables, context_lens, query_start_loc) where each sequence's query rows are cut at
    super-block boundaries into pieces (in order, so the output rows keep theirs), K and V
    are compact float32 caches (n, bs, Hkv, D) holding the named blocks sealed, then from
    their slots, and each piece's table names its own super-block's blocks from their slots
    and every earlier block sealed (-1 and other negatives kept)."""
    num_blocks, bs = k_layer.rows.shape[0], k_layer.block_size
    named = block_tables >= 0
    block_ids = np.unique(block_tables[named])  # (n,)
    if block_ids.size and int(block_ids[-1]) >= num_blocks:
        raise ValueError(f"block_tables holds block {int(block_ids[-1])}, outside the cache "
                         f"({num_blocks} blocks)")
    compact = np.where(named, np.searchsorted(block_ids, np.maximum(block_tables, 0)),
                       block_tables).astype(np.int32)  # sealed copies: 0..n-1
    span = k_layer.window_blocks * bs  # tokens per super-block
    tables, lens, starts = [], [], [0]
    for s in range(context_lens.shape[0]):
        q_len = int(query_start_loc[s + 1] - query_start_loc[s])
        first = int(context_lens[s]) - q_len
        cuts = [first] + list(range((first // span + 1) * span, first + q_len, span)) + [
            first + q_len]
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if b <= a:
                continue
            own = a // span * k_layer.window_blocks  # the piece's super-block's first block
            table = compact[s].copy()
            table[own:] = np.where(table[own:] >= 0, table[own:] + block_ids.size,
                                   table[own:])  # read from the slots
            tables.append(table)
            lens.append(b)
            starts.append(starts[-1] + b - a)
    if block_ids.size == 0:  # nothing to read: one zero block keeps the shapes valid
        block_ids = np.zeros(1, np.int64)
    k = np.concatenate([_sealed(k_layer, block_ids), _widened(k_layer, block_ids)])
    v = np.concatenate([_sealed(v_layer, block_ids), _widened(v_layer, block_ids)])
    return (k, v, np.array(tables, np.int32).reshape(len(tables), -1),
            np.array(lens, np.int32), np.array(starts, np.int32))

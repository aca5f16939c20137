"""The int4 KV cache as `kvcore eval` simulates it: float32 arrays holding exactly what the int4
cache's attention reads (the format of kvcore.cache.int4), for measuring a group size and a window.

A block is sealed (quantized as a whole through the NumPy reference, then read back dequantized)
once it is full and all its tokens are older than the window of the `window` most recent tokens of
its sequence; the window and the unsealed tail are fp16. Sealing follows the cache's order: before
a step, the blocks the step's new tokens push out of the window (when already written); after it,
the new tokens are rounded to fp16 and any block the step filled and pushed out is sealed. The one
difference from a cache that quantizes while it writes: a token is read in float32 by its own
step's attention (the next steps read it as the cache holds it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcore.cache import int4
from kvcore.cache.kv_cache import KVCache


class Int4SimCache(KVCache):
    """A float32 KVCache whose contents follow the int4 cache's (window, sealed blocks)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, group: int = int4.DEFAULT_GROUP, window: int = 0) -> None:
        int4.check_layout(block_size, head_dim, group)
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, "fp32")
        self.group, self.window = group, window

    def _sealed_blocks(self, context_len: int) -> int:
        """Blocks of a sequence of context_len tokens that are sealed (full, out of the window)."""
        return max(context_len - self.window, 0) // self.block_size

    def before_step(self, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                    new_context_lens: Sequence[int]) -> None:
        """Seal the blocks this step pushes out of the window that are already written."""
        for table, old, new in zip(block_tables, context_lens, new_context_lens, strict=True):
            done = old // self.block_size  # whole blocks written before this step
            self._seal(table[self._sealed_blocks(old):min(self._sealed_blocks(new), done)])

    def after_step(self, block_tables: Sequence[Sequence[int]], context_lens: Sequence[int],
                   new_context_lens: Sequence[int]) -> None:
        """Round the step's tokens to fp16 (the window's form), then seal what the step filled."""
        for table, old, new in zip(block_tables, context_lens, new_context_lens, strict=True):
            positions = np.arange(old, new)  # (T,) the tokens this step wrote
            blocks = np.asarray(table, np.int64)[positions // self.block_size]
            slots = blocks * self.block_size + positions % self.block_size
            for caches in (self.key_caches, self.value_caches):
                for cache in caches:
                    rows = cache.reshape(-1, self.num_kv_heads, self.head_dim)  # (slots, H, D)
                    rows[slots] = rows[slots].astype(np.float16)
            sealed = max(self._sealed_blocks(old),
                         min(self._sealed_blocks(new), old // self.block_size))  # before_step's
            self._seal(table[sealed:self._sealed_blocks(new)])

    def _seal(self, block_ids: Sequence[int]) -> None:
        """Quantize each block (all layers at once: the layers' heads are independent groups)
        and store its dequantized form."""
        layers, bs, heads, dim = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        for block_id in block_ids:
            k = np.stack([c[block_id] for c in self.key_caches], axis=1)  # (bs, layers, H, D)
            v = np.stack([c[block_id] for c in self.value_caches], axis=1)
            k_row = int4.quantize_key_block(k.reshape(bs, layers * heads, dim))
            v_row = int4.quantize_value_block(v.reshape(bs, layers * heads, dim), self.group)
            k = int4.dequantize_key_block(k_row, bs, layers * heads, dim)
            v = int4.dequantize_value_block(v_row, bs, layers * heads, dim, self.group)
            k, v = k.reshape(bs, layers, heads, dim), v.reshape(bs, layers, heads, dim)
            for layer in range(layers):
                self.key_caches[layer][block_id] = k[:, layer]
                self.value_caches[layer][block_id] = v[:, layer]

"""A model of the int4 KV cache for tests: float32 arrays holding exactly what the int4 cache's
attention reads (the format of kvcore.cache.int4's NumPy reference), written independently of the
cache's window slots and kernels (it measured the group size and window before the cache existed).

The rule of positions (kvcore.cache.int4_window), for steps that each write within one block (as
`kvcore eval` feeds an int4 cache): a step's rows read the blocks of their own super-block (the
window rounded up to whole blocks, at least one) in fp16 and every earlier block sealed
(quantized as a whole through the NumPy reference, then read back dequantized). The one
difference from the cache: a token is read in float32 by its own step's attention (the next steps
read it as the cache holds it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcore.cache import int4
from kvcore.cache.kv_cache import KVCache


class Int4SimCache(KVCache):
    """A float32 KVCache whose contents follow the int4 cache's (window, sealed blocks), for one
    sequence at a time (reset() starts the next)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, group: int = int4.DEFAULT_GROUP, window: int = 0) -> None:
        int4.check_layout(block_size, head_dim, group)
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, "fp32")
        self.group, self.window_tokens = group, window
        self.num_sealed = 0  # leading blocks of the sequence sealed so far

    def reset(self) -> None:
        self.num_sealed = 0

    def _sealed_blocks(self, context_len: int) -> int:
        """Blocks a step whose first row sits at position context_len reads sealed: those
        before its row's super-block."""
        window_blocks = max(1, -(-self.window_tokens // self.block_size))
        return context_len // self.block_size // window_blocks * window_blocks

    def before_step(self, block_table: Sequence[int], context_len: int) -> None:
        """Seal the blocks behind the super-block of the step's rows."""
        limit = self._sealed_blocks(context_len)
        self._seal(block_table[self.num_sealed:limit])
        self.num_sealed = max(self.num_sealed, limit)

    def after_step(self, block_table: Sequence[int], context_len: int,
                   new_context_len: int) -> None:
        """Round the step's tokens to fp16 (the window's form)."""
        positions = np.arange(context_len, new_context_len)  # (T,) the tokens this step wrote
        blocks = np.asarray(block_table, np.int64)[positions // self.block_size]
        slots = blocks * self.block_size + positions % self.block_size
        for caches in (self.key_caches, self.value_caches):
            for cache in caches:
                rows = cache.reshape(-1, self.num_kv_heads, self.head_dim)  # (slots, H, D)
                rows[slots] = rows[slots].astype(np.float16)

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

"""Random paged-attention problems over an int4 cache (sealed int4 blocks beside fp16 window
blocks), and their float64 oracle over the dequantized cache (kvcore.cache.int4)."""

from __future__ import annotations

import numpy as np

from kernel_problems import BF16, attention_f64, paged_problem
from kvcore.cache import int4


def int4_problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
                 num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 activation: str, group: int, sealed_share: float = 0.7) -> tuple[dict, dict]:
    """(keyword arguments of paged_attention_int4, the dense problem of attention_f64).

    Each sequence's blocks are sealed at random (the block holding its last token stays in the
    window unless it is full); the rest hold their tokens in fp16 window slots. Unused window
    slots and the unused tail of each window block hold NaN, unused int4 rows random bytes, and
    unused block-table entries a block id that would crash a read (paged_problem's poison)."""
    dense = paged_problem(rng, context_lens, q_lens, num_heads, num_kv_heads, head_dim,
                          block_size, "f32", poison=True)
    k_dense, v_dense = dense["k_cache"], dense["v_cache"]  # (num_blocks, bs, Hkv, D) float32
    num_blocks = k_dense.shape[0]
    k_rows = rng.integers(0, 256, (num_blocks, int4.key_row_bytes(block_size, num_kv_heads,
                                                                  head_dim)), dtype=np.uint8)
    v_rows = rng.integers(0, 256, (num_blocks, int4.value_row_bytes(
        block_size, num_kv_heads, head_dim, group)), dtype=np.uint8)
    window_slot = np.full(num_blocks, -1, dtype=np.int32)
    num_slots = num_blocks + 2
    k_window = np.full((num_slots, block_size, num_kv_heads, head_dim), np.nan, np.float16)
    v_window = np.full_like(k_window, np.nan)
    slots = iter(rng.permutation(num_slots).tolist())
    for s, ctx in enumerate(context_lens):
        used = -(-ctx // block_size)
        for i, block in enumerate(dense["block_tables"][s, :used].tolist()):
            tokens = min(block_size, ctx - i * block_size)
            if tokens == block_size and rng.random() < sealed_share:
                k_rows[block] = int4.quantize_key_block(k_dense[block])
                v_rows[block] = int4.quantize_value_block(v_dense[block], group)
                k_dense[block] = int4.dequantize_key_block(k_rows[block], block_size,
                                                           num_kv_heads, head_dim)
                v_dense[block] = int4.dequantize_value_block(v_rows[block], block_size,
                                                             num_kv_heads, head_dim, group)
            else:
                slot = window_slot[block] = next(slots)
                k_window[slot, :tokens] = k_dense[block, :tokens]
                v_window[slot, :tokens] = v_dense[block, :tokens]
                k_dense[block, :tokens] = k_window[slot, :tokens]  # as the window holds them
                v_dense[block, :tokens] = v_window[slot, :tokens]
    act = {"f16": np.float16, "bf16": BF16}[activation]
    dense["query"] = dense["query"].astype(act)
    kwargs = dict(query=dense["query"], k_cache=k_rows, v_cache=v_rows, k_window=k_window,
                  v_window=v_window, window_slot=window_slot,
                  block_tables=dense["block_tables"], context_lens=dense["context_lens"],
                  query_start_loc=dense["query_start_loc"], scale=dense["scale"], group=group)
    return kwargs, dense


def int4_f64(dense: dict, sliding_window: int | None = None) -> np.ndarray:
    """The float64 oracle over the dequantized cache: (T, H, D)."""
    return attention_f64(dense, sliding_window)

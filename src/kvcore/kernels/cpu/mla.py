"""CPU (NumPy) pieces of multi-head latent attention: writing the shared latent cache, the
absorbed attention over it (the paged MQA kernel with K = V = the cached row; the reference of
mla_attention.cu), reading one sequence's latents back, and the causal attention of a chunk
against decompressed per-head keys and values."""

from __future__ import annotations

import numpy as np

from kvcore.kernels.cpu import _store, paged_attention
from kvcore.kernels.cpu.attention_reference import TILE_ELEMENTS, _gather, _softmax_weighted_ones
from kvcore.kernels.cpu.threads import run_parallel, split


def cache_latent(entries: np.ndarray, cache: np.ndarray, slot_mapping: np.ndarray,
                 scale: float = 1.0) -> None:
    """Write this step's (T, 1, W) latent + rope-key rows into their slots of a shared K/V cache
    (num_blocks, block_size, 1, W); slot -1 = skip."""
    if entries.ndim != 3 or cache.ndim != 4 or entries.shape[1:] != cache.shape[2:]:
        raise ValueError(f"entries {entries.shape} do not fit cache {cache.shape}")
    if slot_mapping.shape != (entries.shape[0],):
        raise ValueError(f"slot_mapping shape {slot_mapping.shape} != ({entries.shape[0]},)")
    valid = slot_mapping >= 0
    slots, rows = slot_mapping[valid], entries[valid]
    if slots.size == 0:
        return
    if int(slots.max()) >= cache.shape[0] * cache.shape[1]:
        raise ValueError(f"slot {int(slots.max())} is outside a cache of {cache.shape[0]} blocks "
                         f"x {cache.shape[1]}")
    cache.reshape(-1, *cache.shape[2:])[slots] = _store(rows, cache.dtype, scale)


def mla_paged_attention(query: np.ndarray, cache: np.ndarray, block_tables: np.ndarray,
                        context_lens: np.ndarray, query_start_loc: np.ndarray, kv_lora_rank: int,
                        scale: float, kv_scale: float = 1.0) -> np.ndarray:
    """Absorbed MLA attention: query (T, H, W) = [q_nope W_UK, q_rope] per head against the
    cached rows (num_blocks, block_size, 1, W), each both the key and (its first kv_lora_rank
    columns) the value; returns the latent-space output (T, H, kv_lora_rank)."""
    if not 0 < kv_lora_rank < query.shape[-1]:
        raise ValueError(f"kv_lora_rank must lie in (0, {query.shape[-1]}), got {kv_lora_rank}")
    out = paged_attention(query, cache, cache, block_tables, context_lens, query_start_loc, scale,
                          None, kv_scale, kv_scale)  # (T, H, W): the rope columns are dropped
    return out[:, :, :kv_lora_rank]


def read_latents(cache: np.ndarray, block_table: np.ndarray, num_tokens: int,
                 scale: float = 1.0) -> np.ndarray:
    """Positions [0, num_tokens) of one sequence's shared K/V cache: (num_tokens, W) float32."""
    return _gather(cache, block_table, 0, num_tokens, scale)[:, 0]


def causal_attention(q_nope: np.ndarray, q_rope: np.ndarray, k_nope: np.ndarray,
                     k_rope: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """The n last queries of a sequence of N tokens against its decompressed keys and values.

    q_nope (n, H, Dn), q_rope (n, H, Dr), k_nope (N, H, Dn), k_rope (N, Dr) shared by the heads,
    values (N, H, Dv); query i sits at position N - n + i and sees keys 0..N - n + i.
    Returns (n, H, Dv) float32. Scores are q_nope.k_nope per head plus q_rope.k_rope, the second
    one GEMM for all heads since the rope key is shared.
    """
    q_len, num_heads, _ = q_nope.shape
    num_keys, _, v_dim = values.shape
    first_pos = num_keys - q_len
    k_nope_t = np.ascontiguousarray(k_nope.transpose(1, 2, 0))  # (H, Dn, N)
    k_rope_t = np.ascontiguousarray(k_rope.T)  # (Dr, N)
    # V with a column of ones: the GEMM that weights the values also sums the probabilities
    values_h = np.empty((num_heads, num_keys, v_dim + 1), np.float32)  # (H, N, Dv + 1)
    values_h[..., :v_dim] = values.transpose(1, 0, 2)
    values_h[..., v_dim] = 1.0
    q_nope_h = np.ascontiguousarray(q_nope.transpose(1, 0, 2)) * np.float32(scale)  # (H, n, Dn)
    q_rope_s = q_rope.reshape(q_len * num_heads, -1) * np.float32(scale)  # (n H, Dr)
    out = np.empty((q_len, num_heads, v_dim), dtype=np.float32)  # (n, H, Dv)
    rows_per_tile = max(16, min(64, TILE_ELEMENTS // (num_heads * num_keys)))
    starts = list(range(0, q_len, rows_per_tile))

    def tiles(part: range) -> None:
        for t0 in starts[part.start::part.step]:
            t1 = min(q_len, t0 + rows_per_tile)
            visible = first_pos + t1  # keys any row of the tile may see
            scores = q_nope_h[:, t0:t1] @ k_nope_t[:, :, :visible]  # (H, rows, keys)
            rope = q_rope_s[t0 * num_heads:t1 * num_heads] @ k_rope_t[:, :visible]
            scores += rope.reshape(t1 - t0, num_heads, visible).transpose(1, 0, 2)
            q_pos = np.arange(first_pos + t0, first_pos + t1)[:, None]
            np.copyto(scores, -np.inf, where=np.arange(visible)[None, :] > q_pos)
            o = _softmax_weighted_ones(scores, values_h[:, :visible])  # (H, rows, Dv)
            out[t0:t1] = o.transpose(1, 0, 2)

    num_parts = len(split(len(starts), min_part=2))
    run_parallel(tiles, [range(p, len(starts), num_parts) for p in range(num_parts)])
    return out

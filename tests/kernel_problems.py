"""Random paged-attention problems shared by the emulated and the GPU kernel tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.kernels import cpu as reference
from kvcore.model import BatchInput

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"f32": (np.float32, np.float32), "f16": (np.float16, np.float16),
          "f32-f16": (np.float32, np.float16), "f32-bf16": (np.float32, BF16),
          "bf16": (BF16, BF16), "f16-fp8": (np.float16, FP8), "f32-fp8": (np.float32, FP8)}


def paged_problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
                  num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtypes: str, k_scale: float = 1.0, v_scale: float = 1.0) -> dict:
    """Random K/V in a shuffled paged cache (spare blocks hold garbage) and a mixed batch."""
    act, cache_dtype = DTYPES[dtypes]
    num_seqs = len(context_lens)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    max_blocks = max(blocks_per_seq) + 1
    block_tables = np.full((num_seqs, max_blocks), -1, dtype=np.int32)  # (S, max_blocks)
    ids = rng.permutation(num_blocks)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = ids[start:start + n]
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = np.empty(shape, dtype=cache_dtype)
    v_cache = np.empty(shape, dtype=cache_dtype)
    flat_k = rng.standard_normal((num_blocks * block_size, num_kv_heads, head_dim)) * 2
    flat_v = rng.standard_normal((num_blocks * block_size, num_kv_heads, head_dim))
    slots = np.arange(num_blocks * block_size)
    reference.reshape_and_cache(flat_k.astype(act), flat_v.astype(act), k_cache, v_cache, slots,
                                k_scale, v_scale)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(act)  # (T, H, D)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                context_lens=np.array(context_lens, dtype=np.int32), query_start_loc=qsl,
                scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)


def greedy(model: Any, model_dir: Path, cache_dtype: str, steps: int, device: str = "cpu"
           ) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of `model` after a 9-token prompt, and the prompt's last logits."""
    c = ModelConfig.from_dir(model_dir)
    cache = KVCache(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, cache_dtype, device)
    table = [[6, 1, 4, 7, 2]]
    tokens = np.random.default_rng(3).integers(3, c.vocab_size, size=9).tolist()
    logits = model.forward(BatchInput.build([tokens], [0], table, 4), cache)
    first = logits
    out: list[int] = []
    for _ in range(steps):
        out.append(int(np.argmax(logits[-1])))
        logits = model.forward(BatchInput.build([[out[-1]]], [len(tokens) + len(out) - 1],
                                                table, 4), cache)
    return out, first

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
          "bf16": (BF16, BF16), "f16-fp8": (np.float16, FP8), "f32-fp8": (np.float32, FP8),
          "bf16-fp8": (BF16, FP8)}
POISON_BLOCK = 0x3FFFFFFF  # an unused block-table entry: reading through it would crash


def paged_problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
                  num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtypes: str, k_scale: float = 1.0, v_scale: float = 1.0,
                  poison: bool = False) -> dict:
    """Random K/V in a shuffled paged cache (spare blocks hold garbage) and a mixed batch.

    `poison`: unused block-table entries hold POISON_BLOCK and every slot no sequence owns
    (spare blocks, the tail of each last block) holds NaN, so a kernel that reads one shows."""
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
    if poison:
        used = np.zeros(num_blocks * block_size, dtype=bool)
        for s_, ctx in enumerate(context_lens):
            pos = np.arange(ctx)
            used[block_tables[s_, pos // block_size].astype(np.int64) * block_size
                 + pos % block_size] = True
        for cache in (k_cache, v_cache):
            cache.reshape(num_blocks * block_size, num_kv_heads, head_dim)[~used] = np.nan
        block_tables[block_tables < 0] = POISON_BLOCK
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    query = rng.standard_normal((int(qsl[-1]), num_heads, head_dim)).astype(act)  # (T, H, D)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                context_lens=np.array(context_lens, dtype=np.int32), query_start_loc=qsl,
                scale=head_dim ** -0.5, k_scale=k_scale, v_scale=v_scale)


def attention_f64(problem: dict, sliding_window: int | None = None) -> np.ndarray:
    """The oracle, from first principles: each query row against its sequence's keys gathered
    one position at a time through the block table, float64 softmax; (T, H, D) float64."""
    query = problem["query"].astype(np.float64)
    k_cache, v_cache = problem["k_cache"], problem["v_cache"]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros(query.shape, dtype=np.float64)  # (T, H, D)
    qsl = problem["query_start_loc"]
    for s, ctx in enumerate(problem["context_lens"].tolist()):
        pos = np.arange(ctx)
        slots = problem["block_tables"][s, pos // block_size].astype(np.int64) * block_size \
            + pos % block_size
        keys = k_cache.reshape(-1, num_kv_heads, k_cache.shape[3])[slots].astype(np.float64)
        values = v_cache.reshape(-1, num_kv_heads, v_cache.shape[3])[slots].astype(np.float64)
        keys *= problem["k_scale"]
        values *= problem["v_scale"]
        q_len = int(qsl[s + 1] - qsl[s])
        for i in range(q_len):
            qpos = ctx - q_len + i  # the query's own position: it sees keys 0..qpos
            lo = qpos - sliding_window + 1 if sliding_window else 0
            visible = slice(max(lo, 0), qpos + 1)
            for h in range(num_heads):
                q = query[qsl[s] + i, h]
                scores = keys[visible, h // group] @ q * problem["scale"]
                p = np.exp(scores - scores.max())
                out[qsl[s] + i, h] = p @ values[visible, h // group] / p.sum()
    return out


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


def mla_problem(rng: np.random.Generator, context_lens: list[int], q_lens: list[int],
                num_heads: int, kv_lora_rank: int, rope_dim: int, block_size: int, dtypes: str,
                kv_scale: float = 1.0, poison: bool = True) -> dict:
    """A random absorbed-MLA problem: the shuffled paged cache of paged_problem with one
    "KV head" of width kv_lora_rank + rope_dim (each row both key and value) and queries of
    that width per head; the keyword arguments of kernels.mla_paged_attention."""
    width = kv_lora_rank + rope_dim
    p = paged_problem(rng, context_lens, q_lens, num_heads, 1, width, block_size, dtypes,
                      kv_scale, kv_scale, poison)
    return dict(query=p["query"], cache=p["k_cache"], block_tables=p["block_tables"],
                context_lens=p["context_lens"], query_start_loc=p["query_start_loc"],
                kv_lora_rank=kv_lora_rank, scale=p["scale"], kv_scale=kv_scale)


def mla_f64(problem: dict) -> np.ndarray:
    """The float64 oracle of the absorbed MLA attention: attention_f64 with K = V = the cached
    row, the value's rope columns dropped; (T, H, kv_lora_rank)."""
    dense = attention_f64(dict(problem, k_cache=problem["cache"], v_cache=problem["cache"],
                               k_scale=problem["kv_scale"], v_scale=problem["kv_scale"]))
    return dense[:, :, :problem["kv_lora_rank"]]

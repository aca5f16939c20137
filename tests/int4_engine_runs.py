"""The int4 engine run that the emulated and the GPU tests compare across kernel paths."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_helpers import assert_pool_empty, run_all
from kvcore.cache import int4
from kvcore.cache.int4_window import WindowOp
from kvcore.device import to_numpy
from kvcore.engine import Engine
from kvcore.kernels.cpu import attention_reference
from kvcore.kernels.cpu.kv_int4 import Int4Layer
from kvcore.sampling import SamplingParams


def attention_by_table(query: np.ndarray, k: Int4Layer, v: Int4Layer, block_tables: np.ndarray,
                       context_lens: np.ndarray, query_start_loc: np.ndarray, scale: float,
                       sliding_window: int | None = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> np.ndarray:
    """The CUDA kernels' rule over NumPy (their oracle): a block is read from its window slot
    while it holds one, else from its sealed rows, for every query row alike. (The CPU path
    reads by the rule of positions instead: kvcore.cache.int4_window.)"""
    ids = np.unique(block_tables[block_tables >= 0])  # (n,)
    _, bs, heads, dim = k.shape

    def read(layer: Int4Layer) -> np.ndarray:
        blocks = []
        for b in ids.tolist():
            slot = int(layer.window_slot[b])
            if slot >= 0:
                blocks.append(layer.window[slot].astype(np.float32))
            elif layer.is_key:
                blocks.append(int4.dequantize_key_block(layer.rows[b], bs, heads, dim))
            else:
                blocks.append(int4.dequantize_value_block(layer.rows[b], bs, heads, dim,
                                                          layer.group))
        return np.stack(blocks).astype(np.float32)  # (n, bs, Hkv, D)

    tables = np.where(block_tables >= 0, np.searchsorted(ids, np.maximum(block_tables, 0)),
                      block_tables).astype(np.int32)
    step = attention_reference.plan(tables, context_lens, query_start_loc, bs, sliding_window)
    return attention_reference.attend(query, read(k), read(v), step, scale, sliding_window, k_scale,
                                      v_scale)


def run(engine: Engine) -> tuple[list[list[int]], list[WindowOp]]:
    """Two prompts sharing 24 tokens (the second hits the first's sealed blocks), then n = 2
    forks of a prompt ending inside a block (copy-on-write of an open block); greedy, 12
    tokens each. Returns every sequence's tokens and the window operations the steps ran."""
    ops: list[WindowOp] = []
    apply = engine.kv_cache.apply_window_ops

    def recording(step_ops: list[WindowOp]) -> None:
        ops.extend(step_ops)
        apply(step_ops)
    engine.kv_cache.apply_window_ops = recording  # type: ignore[method-assign]
    rng = np.random.default_rng(11)
    shared = rng.integers(3, 259, 24).tolist()
    prompts = [shared + rng.integers(3, 259, 13).tolist(),
               shared + rng.integers(3, 259, 6).tolist(), rng.integers(3, 259, 21).tolist()]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens: list[list[int]] = []
    for prompt, n in zip(prompts, (1, 1, 2), strict=True):  # one after another: cache hits
        (out,) = run_all(engine, [prompt], dataclasses.replace(greedy, n=n))
        tokens += [c.token_ids for c in out.outputs]
    assert_pool_empty(engine)
    kv_cache = engine.kv_cache
    assert kv_cache.window is not None
    assert kv_cache.window.num_free_slots == kv_cache.window.num_slots
    kv_cache.apply_window_ops(kv_cache.take_window_ops())  # the last seals and releases
    assert (to_numpy(kv_cache.window_slot) == -1).all()  # the device table agrees
    return tokens, ops

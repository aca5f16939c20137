"""The int4 engine run that the emulated and the GPU tests compare across kernel paths."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_helpers import assert_pool_empty, run_all
from kvcore.cache.int4_window import WindowOp
from kvcore.device import to_numpy
from kvcore.engine import Engine
from kvcore.sampling import SamplingParams


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

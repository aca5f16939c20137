"""Helpers for engine tests on the tiny random-weight model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling import BeamSearchParams, SamplingParams, SamplingRow


def make_engine(model_dir: Path, **engine_args: Any) -> Engine:
    engine_args.setdefault("block_size", 4)
    engine_args.setdefault("num_blocks", 512)
    return Engine(engine_config(str(model_dir), **engine_args))


def inject_sampling_fault(engine: Engine, fault: Callable[[Sequence[SamplingRow]], None]) -> None:
    """Before each draw the engine's sampler calls `fault(rows)`, which raises to fail the draw."""
    sampler = engine.core.sampler
    real = sampler.launch

    def launch(logits: Any, rows: Sequence[SamplingRow]) -> Any:
        fault(rows)
        return real(logits, rows)
    sampler.launch = launch  # type: ignore[method-assign]


def random_prompts(seed: int, num: int, low: int = 1, high: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 259, size=int(n)).tolist() for n in rng.integers(low, high, size=num)]


def run_all(engine: Engine, prompts: list[list[int]] | list[str],
            params: SamplingParams | BeamSearchParams | list[SamplingParams],
            cache_salt: str | None = None) -> list[RequestOutput]:
    """Add every prompt (under `cache_salt`), step until done; the final outputs in prompt
    order."""
    per = params if isinstance(params, list) else [params] * len(prompts)
    base = len(engine.scheduler.seqs) + id(prompts) % 100_000
    ids = [f"r{base}-{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, per, strict=True):
        engine.add_request(request_id, prompt, p, cache_salt=cache_salt)
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [merge_outputs(outputs[i]) for i in ids]


def assert_pool_empty(engine: Engine) -> None:
    assert engine.kv.usage() == 0.0
    assert all(block.ref_count == 0 for block in engine.kv.pool.blocks)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not engine.kv.seq_ids()


def allowed_tokens(filler: Any, matcher: Any) -> set[int]:
    """The token ids a constraint matcher allows next (its packed mask from `filler`, a
    constraints.MaskFiller, unpacked)."""
    mask = filler.fill([matcher])[0]
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def collect(seen: dict[str, list[RequestOutput]], out: RequestOutput) -> RequestOutput | None:
    """Keep a request's outputs in `seen`; once it finishes, all of them merged (each output
    carries only what changed)."""
    seen.setdefault(out.request_id, []).append(out)
    return merge_outputs(seen.pop(out.request_id)) if out.finished else None

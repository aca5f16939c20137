"""Fault injection: a failure in one request's sampling, beam step, detokenization or stop checks
fails that request alone; a failed forward pass fails only its step's requests. Every other
request finishes byte-identical to a run without the fault, and no block leaks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import (
    assert_pool_empty,
    collect,
    inject_sampling_fault,
    make_engine,
    random_prompts,
)
from kvcore.engine import AsyncEngine, Engine, RequestFailed
from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling import BeamSearchParams, SamplingParams


class Boom(RuntimeError):
    pass


PROMPTS = random_prompts(seed=11, num=6, low=5, high=30)
FAULTY = random_prompts(seed=12, num=1, low=12, high=13)[0]  # three blocks of 4
PARAMS: list[SamplingParams | BeamSearchParams] = [
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=3, n=2, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2),
    BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.7, seed=1, repetition_penalty=1.3,
                   ignore_eos=True),
]
FAULT_SAMPLING = SamplingParams(max_tokens=10, temperature=0.8, seed=666, stop=["zz"],
                                ignore_eos=True)


def _run(engine: Engine, requests: list[tuple[str, list[int], Any]],
         inject: Callable[[Engine], None] | None = None) -> dict[str, RequestOutput]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    if inject is not None:
        inject(engine)
    done: dict[str, RequestOutput] = {}
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if (whole := collect(seen, out)) is not None:
                done[out.request_id] = whole
    return done


def _others() -> list[tuple[str, list[int], Any]]:
    return [(f"ok{i}", p, params) for i, (p, params) in enumerate(zip(PROMPTS, PARAMS,
                                                                         strict=True))]


def _texts(outputs: dict[str, RequestOutput]) -> dict[str, list[tuple[list[int], str]]]:
    return {rid: [(c.token_ids, c.text) for c in o.outputs] for rid, o in outputs.items()
            if rid.startswith("ok")}


@pytest.fixture(scope="module")
def baseline(tiny_model_dir: Path) -> dict[str, list[tuple[list[int], str]]]:
    engine = make_engine(tiny_model_dir)
    outputs = _run(engine, _others())
    assert all(o.error is None for o in outputs.values())
    return _texts(outputs)


def _sampler_fault(engine: Engine) -> None:
    def fault(rows: Any) -> None:
        if any(r.params.seed == 666 for r in rows):
            raise Boom("sampler")

    inject_sampling_fault(engine, fault)


def _detokenizer_fault(engine: Engine) -> None:
    choice = engine.output_processor._requests["bad"].choices[0]
    real = choice.detokenizer.add

    def add(token_id: int) -> str:
        if choice.num_tokens >= 3:
            raise Boom("detokenizer")
        return real(token_id)

    choice.detokenizer.add = add  # type: ignore[method-assign]


def _stop_check_fault(engine: Engine) -> None:
    choice = engine.output_processor._requests["bad"].choices[0]
    assert choice.stop_window  # "bad" has stop strings: its text is searched every token

    class Poisoned(str):
        def __add__(self, other: str) -> str:
            raise Boom("stop check")

    choice.tail = Poisoned("")


def _beam_fault(engine: Engine) -> None:
    policy = engine.beams._policies["bad"]
    real = policy.search.step
    calls = []

    def step(logprobs: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise Boom("beam step")
        return real(logprobs)

    policy.search.step = step  # type: ignore[method-assign]


@pytest.mark.parametrize(("stage", "params", "inject"), [
    ("sampling", FAULT_SAMPLING, _sampler_fault),
    ("output processing", FAULT_SAMPLING, _detokenizer_fault),
    ("output processing", FAULT_SAMPLING, _stop_check_fault),
    ("beam search", BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True), _beam_fault),
], ids=["sampling", "detokenization", "stop-checks", "beam-step"])
def test_a_per_request_fault_fails_that_request_alone(
        tiny_model_dir: Path, baseline: dict[str, Any], stage: str, params: Any,
        inject: Callable[[Engine], None]) -> None:
    engine = make_engine(tiny_model_dir)
    requests = _others()
    requests.insert(3, ("bad", FAULTY, params))
    outputs = _run(engine, requests, inject)
    bad = outputs["bad"]
    assert bad.finished and bad.error is not None and bad.error.startswith(stage)
    assert "Boom" in bad.error
    assert _texts(outputs) == baseline
    assert all(o.error is None for rid, o in outputs.items() if rid != "bad")
    assert_pool_empty(engine)


def test_a_failed_forward_pass_fails_its_step_and_the_queue_goes_on(
        tiny_model_dir: Path, baseline: dict[str, Any]) -> None:
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    model = engine.core.runner.model
    real = model.forward
    calls = []

    def forward(batch: Any, kv_cache: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Boom("forward")
        return real(batch, kv_cache)

    model.forward = forward  # type: ignore[method-assign]
    # the first step holds "bad" and "bad2" (max_num_seqs 2): both fail; the rest queue behind
    requests = [("bad", FAULTY, FAULT_SAMPLING),
                ("bad2", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0)),
                *_others()]
    outputs = _run(engine, requests)
    for rid in ("bad", "bad2"):
        assert outputs[rid].error is not None
        assert outputs[rid].error.startswith("forward pass")  # type: ignore[union-attr]
    assert _texts(outputs) == baseline
    assert_pool_empty(engine)


def test_blocks_of_a_failed_forward_pass_never_serve_a_prefix_hit(tiny_model_dir: Path) -> None:
    """Blocks hashed for the failed step were never written: a later prompt sharing that
    prefix must recompute it, not read stale K/V."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _run(make_engine(tiny_model_dir), [("p", FAULTY, greedy)])["p"]
    engine = make_engine(tiny_model_dir)
    real = engine.core.runner.model.forward
    calls = []

    def forward(batch: Any, kv_cache: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Boom("forward")
        return real(batch, kv_cache)

    engine.core.runner.model.forward = forward  # type: ignore[method-assign]
    assert _run(engine, [("first", FAULTY, greedy)])["first"].error is not None
    again = _run(engine, [("again", FAULTY, greedy)])["again"]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_pool_empty(engine)


def test_async_engine_streams_the_error_to_its_consumer_only(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    _sampler_fault(engine)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = _run(make_engine(tiny_model_dir), [("ok", PROMPTS[1], greedy)])["ok"]

    async def main() -> tuple[list[int], BaseException | None]:
        async with AsyncEngine(engine) as ae:
            async def good() -> list[int]:
                outputs = [out async for out in ae.generate(PROMPTS[1], greedy)]
                return merge_outputs(outputs).outputs[0].token_ids

            async def bad() -> BaseException | None:
                try:
                    async for _ in ae.generate(FAULTY, FAULT_SAMPLING):
                        pass
                except RequestFailed as e:
                    return e
                return None

            tokens, error = await asyncio.gather(good(), bad())
            assert_pool_empty(engine)
            return tokens, error

    tokens, error = asyncio.run(main())
    assert tokens == expected.outputs[0].token_ids
    assert isinstance(error, RequestFailed) and "Boom" in str(error)

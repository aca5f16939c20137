"""Same request, same answer: run a mix of requests through one engine under a random schedule
(token budget, pool size, prefix cache, speculation, async stepping) and each request alone on
a fresh engine, and compare what they answered bit for bit (token ids, logprobs, top logprobs).

Used by tests/test_same_answer.py (the Hypothesis sweep on the tiny model, every weight format
and KV dtype) and by the default-model cases; a guard that any later change of a kernel, the
scheduler or the sampler must keep passing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import strategies as st

from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling import BeamSearchParams, SamplingParams
from kvcore.sampling.constraints import Constraint

Params = SamplingParams | BeamSearchParams
# what a request answered: per choice, its token ids and each token's (logprob, top)
Answer = tuple[tuple[tuple[int, ...], tuple[Any, ...]], ...]


@dataclass(frozen=True)
class Case:
    """One request of a mix: its prompt, parameters and tenant salt."""

    prompt: tuple[int, ...]
    params: Params
    salt: str | None = None


@dataclass(frozen=True)
class Schedule:
    """How the mixed run's engine is driven (the request's own answer must not depend on it)."""

    max_num_batched_tokens: int = 2048
    num_blocks: int = 512
    max_num_seqs: int = 256
    warm: tuple[int, ...] = ()  # cases run first (their prefixes cached), then the whole mix
    speculative: dict[str, Any] | None = None
    async_scheduling: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)


def answer(out: RequestOutput) -> Answer:
    """Token ids and logprobs of every choice, in choice order."""
    choices = sorted(out.outputs, key=lambda c: c.index)
    return tuple((tuple(c.token_ids),
                  tuple((lp.token_id, lp.logprob, lp.top) for lp in (c.logprobs or ())))
                 for c in choices)


def make(model_dir: Path, model: Any = None, **engine_args: Any) -> Engine:
    """A fresh engine (its own pool, scheduler, caches); `model`: weights already loaded, shared
    between engines (they hold no state of a request)."""
    return Engine(engine_config(str(model_dir), **engine_args), model=model)


def run(engine: Engine, cases: list[Case], tag: str) -> list[Answer]:
    """Add every case at once, step until done; answers in case order."""
    ids = [f"{tag}-{i}" for i in range(len(cases))]
    for request_id, case in zip(ids, cases, strict=True):
        engine.add_request(request_id, list(case.prompt), case.params, cache_salt=case.salt)
    outputs: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():  # each output carries what changed: merged at the end
            outputs[out.request_id].append(out)
    return [answer(merge_outputs(outputs[i])) for i in ids]


def alone(model_dir: Path, case: Case, **engine_args: Any) -> Answer:
    """The case on a fresh engine of its own (default schedule: nothing cached, no
    speculation, synchronous steps, a pool and a budget that never cut it)."""
    return run(make(model_dir, **engine_args), [case], "alone")[0]


def together(model_dir: Path, cases: list[Case], schedule: Schedule,
             **engine_args: Any) -> list[Answer]:
    """The cases in one engine driven by `schedule` (warm cases first, then all)."""
    engine = make(model_dir, max_num_batched_tokens=schedule.max_num_batched_tokens,
                  num_blocks=schedule.num_blocks, max_num_seqs=schedule.max_num_seqs,
                  speculative_config=schedule.speculative,
                  async_scheduling=schedule.async_scheduling, **engine_args)
    if schedule.warm:
        run(engine, [cases[i] for i in schedule.warm], "warm")
    return run(engine, cases, "mix")


def mismatches(model_dir: Path, cases: list[Case], schedule: Schedule,
               **engine_args: Any) -> list[tuple[int, Answer, Answer]]:
    """(case index, alone, together) for every case whose answers differ."""
    mixed = together(model_dir, cases, schedule, **engine_args)
    out = []
    for i, (case, got) in enumerate(zip(cases, mixed, strict=True)):
        want = alone(model_dir, case, **engine_args)
        if got != want:
            out.append((i, want, got))
    return out


def _prompts(draw: st.DrawFn, vocab: tuple[int, int], num: int, max_len: int) -> list[tuple]:
    """Prompts sharing prefixes: some extend a common stem (prefix-cache hits, whole and
    partial blocks), some repeat a pattern (speculation finds drafts), some are unrelated."""
    low, high = vocab
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    stem = rng.integers(low, high, int(rng.integers(4, max_len))).tolist()
    prompts = []
    for _ in range(num):
        kind = draw(st.sampled_from(["stem", "stem", "pattern", "fresh"]))
        tail = rng.integers(low, high, int(rng.integers(1, max_len // 2 + 2))).tolist()
        if kind == "stem":
            prompts.append(tuple(stem[:int(rng.integers(1, len(stem) + 1))] + tail))
        elif kind == "pattern":
            prompts.append(tuple((tail[:int(rng.integers(2, 5))] * max_len)[:max_len]))
        else:
            prompts.append(tuple(tail))
    return prompts


@st.composite
def params(draw: st.DrawFn, vocab: tuple[int, int], max_tokens: int,
           constraints: bool = True) -> Params:
    """Greedy and seeded rows, n > 1, beams, stop strings and ids, penalties, logprobs,
    constrained rows."""
    kind = draw(st.sampled_from(["greedy", "seeded", "seeded", "beam"]))
    tokens = draw(st.integers(max_tokens // 2, max_tokens))
    if kind == "beam":
        return BeamSearchParams(beam_width=draw(st.integers(1, 3)), max_tokens=tokens,
                                ignore_eos=True)
    constraint = None
    if constraints and draw(st.integers(0, 5)) == 0:
        constraint = draw(st.sampled_from([Constraint("regex", "[a-f]{1,5}( [0-9]{1,3})?"),
                                           Constraint("choice", '["yes", "no", "maybe"]')]))
    return SamplingParams(
        n=draw(st.integers(1, 3)) if kind == "seeded" else 1,
        max_tokens=tokens,
        temperature=0.0 if kind == "greedy" else draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_k=draw(st.sampled_from([None, None, 5])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9])),
        seed=draw(st.integers(0, 2**31)) if kind == "seeded" else None,
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.2])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])),
        presence_penalty=draw(st.sampled_from([0.0, 0.3])),
        stop=draw(st.sampled_from([(), (), ("e",), (" ", "a")])),
        stop_token_ids=draw(st.sampled_from([(), (), (vocab[0] + 7,)])),
        logprobs=draw(st.sampled_from([None, 0, 3])),
        ignore_eos=True,
        constraint=constraint)


@st.composite
def mixes(draw: st.DrawFn, vocab: tuple[int, int], max_prompt: int, max_tokens: int,
          max_cases: int = 5, constraints: bool = True) -> tuple[list[Case], Schedule]:
    """A mix of requests and a schedule for running them together: small token budgets (a
    prompt cut into many chunks), pools small enough to preempt, prefixes cached or not,
    speculation ngram / suffix / off, sync or async steps."""
    num = draw(st.integers(1, max_cases))
    prompts = _prompts(draw, vocab, num, max_prompt)
    salt = draw(st.sampled_from([None, "tenant-a"]))
    cases = [Case(p, draw(params(vocab, max_tokens, constraints)), salt) for p in prompts]
    spec = draw(st.sampled_from([None, "ngram", "suffix"]))
    speculative = None if spec is None else {
        "method": spec, "num_speculative_tokens": draw(st.integers(1, 4)),
        "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    widest = max(getattr(c.params, "n", 1) * getattr(c.params, "beam_width", 1)
                 for c in cases)
    longest = max(len(c.prompt) + c.params.max_tokens for c in cases)  # type: ignore[operator]
    # blocks of 4 (the tiny tests' default) with a draft's lookahead: the widest request alone
    # fits a pool of `need`; the others then wait, or grow into each other and preempt
    need = widest * (-(-(longest + 5) // 4) + 1)
    schedule = Schedule(
        max_num_batched_tokens=draw(st.sampled_from([max(widest * 5, 8), 16, 37, 2048])),
        num_blocks=draw(st.sampled_from([need, need + 6, 512])),
        max_num_seqs=draw(st.sampled_from([max(widest, 3), 256])),
        warm=tuple(sorted(set(draw(st.lists(st.integers(0, num - 1), max_size=2))))),
        speculative=speculative,
        async_scheduling=draw(st.booleans()))
    return cases, schedule

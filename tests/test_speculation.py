"""Speculative decoding changes the speed, never the output: every request's tokens, text,
finish reasons and logprobs are the same with speculation on and off (greedy and seeded, with
every processor), alone, in mixed batches with forks and beams, under preemption, with async
scheduling, and with aborts; every block comes back to the pool. The fake device's logits depend
on the last token only (order 1), so its outputs loop and drafts are often accepted; its K/V
slots hold token ids, so a rejected draft left where the model reads it would change them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import assert_pool_empty, collect, make_engine, random_prompts
from fake_device import fake_engine
from kvcore.engine import Engine
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams

PROMPTS = random_prompts(seed=26, num=12, low=3, high=30)
IGNORE = {"ignore_eos": True}
MIX: list[SamplingParams | BeamSearchParams] = [
    SamplingParams(max_tokens=30, temperature=0.0, **IGNORE),
    SamplingParams(max_tokens=30, temperature=0.3, seed=5, **IGNORE),
    SamplingParams(max_tokens=24, temperature=0.4, top_k=5, seed=3, logprobs=2, **IGNORE),
    SamplingParams(max_tokens=24, temperature=0.3, top_p=0.8, min_p=0.05, seed=4),
    SamplingParams(max_tokens=24, temperature=0.5, seed=1, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2, **IGNORE),
    SamplingParams(max_tokens=24, temperature=0.0, min_tokens=12, logprobs=0),
    SamplingParams(max_tokens=24, temperature=0.0, logit_bias={9: 2.5, 70: -1.0}, **IGNORE),
    SamplingParams(max_tokens=26, temperature=0.2, seed=8, stop_token_ids=[40, 41, 42, 43]),
    SamplingParams(max_tokens=16, temperature=0.6, seed=2, n=2, **IGNORE),
    BeamSearchParams(beam_width=2, max_tokens=6),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=3, temperature=0.0, **IGNORE),
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
          "prompt_lookup_min": 1}


def _summary(out: RequestOutput) -> Any:
    return (out.error, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
                         c.cumulative_logprob) for c in out.outputs])


def _run(engine: Engine, requests: list[tuple[str, list[int], Any]],
         aborts: dict[int, list[str]] | None = None,
         arrivals: dict[int, list[tuple[str, list[int], Any]]] | None = None) -> dict[str, Any]:
    """Every request to the end; `aborts` / `arrivals`: aborted / added before step N."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done: dict[str, Any] = {}
    seen: dict[str, list[RequestOutput]] = {}
    num_steps = 0
    while engine.has_unfinished_requests() or any(n >= num_steps for n in arrivals or {}):
        for request_id, prompt, params in (arrivals or {}).get(num_steps, []):
            engine.add_request(request_id, prompt, params)
        for request_id in (aborts or {}).get(num_steps, []):
            out = engine.abort_request(request_id)
            if out is not None and (whole := collect(seen, out)) is not None:
                done[request_id] = _summary(whole)
        for out in engine.step():
            if (whole := collect(seen, out)) is not None:
                done[out.request_id] = _summary(whole)
        num_steps += 1
    return done


def _requests(picks: list[tuple[int, int]]) -> list[tuple[str, list[int], Any]]:
    return [(f"r{i}", PROMPTS[p], MIX[m]) for i, (p, m) in enumerate(picks)]


def _fake(model_dir: Path, spec: dict[str, Any] | None, async_scheduling: bool = False,
          **engine_args: Any) -> Engine:
    engine_args.setdefault("max_num_batched_tokens", 64)
    return fake_engine(model_dir, async_scheduling, async_scheduling, order=1,
                       max_delay_s=0.0005, speculative_config=spec, **engine_args)


def _with_stop_strings(model_dir: Path) -> list[tuple[str, list[int], Any]]:
    """The mix plus requests whose stop strings come from their own reference text, so a stop
    string may complete in the middle of a step's accepted tokens."""
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = _run(_fake(model_dir, None), [("a", PROMPTS[0], base), ("b", PROMPTS[1], base)])
    stops = [next(c for c in ref[rid][1][0][1][6:] if c.isascii() and c.isprintable())
             for rid in ("a", "b")]
    return [*_requests([(i, i) for i in range(len(MIX))]),
            ("s0", PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                              stop=[stops[0]])),
            ("s1", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                              stop=[stops[1]], include_stop_str_in_output=True))]


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("num_blocks", [512, 40], ids=["roomy", "preempting"])
def test_outputs_are_identical_on_and_off(tiny_model_dir: Path, spec: dict[str, Any],
                                          async_scheduling: bool, num_blocks: int) -> None:
    requests = _with_stop_strings(tiny_model_dir)
    off = _run(_fake(tiny_model_dir, None, num_blocks=num_blocks), requests)
    engine = _fake(tiny_model_dir, spec, async_scheduling, num_blocks=num_blocks,
                   max_num_seqs=16)
    on = _run(engine, requests)
    assert on == off
    assert all(error is None for error, _ in on.values())
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections happened too
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]
    if num_blocks == 40:
        assert engine.scheduler.num_preemptions > 0
    assert_pool_empty(engine)


def test_each_request_alone_matches_and_reports_its_acceptance(tiny_model_dir: Path) -> None:
    for i, params in enumerate(MIX[:8]):
        requests = [(f"r{i}", PROMPTS[i], params)]
        engine = _fake(tiny_model_dir, NGRAM)
        assert _run(engine, requests) == _run(_fake(tiny_model_dir, None), requests)
        assert_pool_empty(engine)
    engine = _fake(tiny_model_dir, NGRAM)
    engine.add_request("x", PROMPTS[0], MIX[0])
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None  # (its metrics are the request's, whatever else it carries)
    stats = engine.stats().spec_decode
    assert stats is not None and final.metrics.num_draft_tokens == stats.num_draft_tokens > 0
    assert final.metrics.num_accepted_tokens == stats.num_accepted_tokens
    assert final.metrics.acceptance == stats.num_accepted_tokens / stats.num_draft_tokens


def test_forks_and_beams_do_not_speculate_but_share_the_batch(tiny_model_dir: Path) -> None:
    requests = _requests([(0, 8), (1, 9), (2, 0)])  # n = 2, a beam search, a greedy one
    engine = _fake(tiny_model_dir, NGRAM)
    drafted: set[str] = set()
    real = engine.scheduler.schedule

    def schedule(drafts: Any = None) -> Any:
        out = real(drafts)
        drafted.update(item.seq_id for item in out.scheduled if item.num_draft_tokens)
        return out

    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    assert _run(engine, requests) == _run(_fake(tiny_model_dir, None), requests)
    assert drafted == {"r2"}
    assert_pool_empty(engine)


def test_the_prefix_cache_holds_only_accepted_tokens(tiny_model_dir: Path) -> None:
    """A prompt that continues a speculated output hits the blocks it filled: the fake device
    reads every token back from its K slot, so a rejected draft left in a cached block would
    change the output."""
    first = SamplingParams(max_tokens=30, temperature=0.3, seed=7, ignore_eos=True)
    engine = _fake(tiny_model_dir, NGRAM)
    out = _run(engine, [("a", PROMPTS[3], first)])
    longer = PROMPTS[3] + out["a"][1][0][0] + PROMPTS[4]
    follow = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = _run(engine, [("b", longer, follow)])
    assert engine.kv.num_prefix_hits >= len(PROMPTS[3]) + 24
    assert got == _run(_fake(tiny_model_dir, None, enable_prefix_caching=False),
                       [("b", longer, follow)])
    assert_pool_empty(engine)


def test_aborts_mid_verify_leak_nothing(tiny_model_dir: Path) -> None:
    requests = _requests([(i, i % 8) for i in range(8)])
    reference = _run(_fake(tiny_model_dir, None), requests)
    for async_scheduling in (False, True):
        engine = _fake(tiny_model_dir, NGRAM, async_scheduling)
        aborted = ["r1", "r4", "r6"]
        got = _run(engine, requests, aborts={4: aborted[:1], 9: aborted[1:]})
        assert {k: v for k, v in got.items() if k not in aborted} == {
            k: v for k, v in reference.items() if k not in aborted}
        for rid in aborted:
            for mine, full in zip(got[rid][1], reference[rid][1], strict=True):
                assert full[0][:len(mine[0])] == mine[0]
        assert_pool_empty(engine)


def test_no_speculation_above_max_batch(tiny_model_dir: Path) -> None:
    requests = _requests([(i, 0) for i in range(5)])
    engine = _fake(tiny_model_dir, {**NGRAM, "max_batch_for_speculation": 4})
    assert _run(engine, requests) == _run(_fake(tiny_model_dir, None), requests)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_drafts == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_batch_crossing_max_batch_mid_run(tiny_model_dir: Path,
                                              async_scheduling: bool) -> None:
    """Requests arrive while two speculate: the batch grows past max_batch_for_speculation in
    the step that verifies their drafts, then shrinks below it again."""
    long = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    requests = [("a", PROMPTS[0], long), ("b", PROMPTS[1], long),
                *_requests([(i, i % 3) for i in range(2, 7)])]
    arrivals = {24: requests[2:5], 26: requests[5:]}  # the first two loop (and draft) by then
    engine = _fake(tiny_model_dir, {**NGRAM, "max_batch_for_speculation": 3}, async_scheduling,
                   max_num_batched_tokens=24)
    assert _run(engine, requests[:2], arrivals=arrivals) == _run(
        _fake(tiny_model_dir, None), requests)
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    assert engine.stats().num_running == 0
    assert_pool_empty(engine)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, len(MIX) - 1)),
                min_size=1, max_size=7),
       st.sampled_from([32, 64, 512]), st.sampled_from([6, 16, 2048]), st.booleans(),
       st.sampled_from([NGRAM, SUFFIX]))
def test_random_mixes_are_identical_on_and_off(tiny_model_dir: Path, picks: list[tuple[int, int]],
                                               num_blocks: int, budget: int,
                                               async_scheduling: bool,
                                               spec: dict[str, Any]) -> None:
    requests = _requests(picks)
    outputs = []
    for config in (None, spec):
        engine = _fake(tiny_model_dir, config, async_scheduling and config is not None,
                       num_blocks=num_blocks, max_num_batched_tokens=budget)
        try:
            outputs.append(_run(engine, requests))
        except ValueError as e:  # a mix that can never fit this pool: refused either way
            assert "pool" in str(e)
            return
        assert_pool_empty(engine)
    assert outputs[0] == outputs[1]


def test_tiny_model_tokens_match_on_and_off(tiny_model_dir: Path) -> None:
    """The real forward verifying drafts as a causal chunk: the same tokens (greedy and
    seeded) as one token per step; logprobs agree to float rounding (a chunk's matmuls may
    round differently from a single row's)."""
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=24, temperature=0.7, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.1,
                             ignore_eos=True)]
    prompts = [p * 3 for p in PROMPTS[:3]]  # repeated: the model's output tends to repeat
    requests = [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    off = _run(make_engine(tiny_model_dir), requests)
    engine = make_engine(tiny_model_dir, speculative_config=NGRAM)
    on = _run(engine, requests)
    for rid, (error, choices) in off.items():
        assert on[rid][0] is error is None
        assert [c[:4] for c in on[rid][1]] == [c[:4] for c in choices]
        for mine, theirs in zip(on[rid][1], choices, strict=True):
            for a, b in zip(mine[4] or [], theirs[4] or [], strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    stats = engine.stats().spec_decode
    assert stats is not None and stats.num_drafts > 0
    assert engine.stats().num_running == 0
    assert_pool_empty(engine)

"""Async scheduling (step N+1 scheduled and launched while the device runs step N): outputs are
identical with it on and off, on a fake device whose forward runs in a worker thread, and on
the tiny model; every block returns to the pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import (
    assert_pool_empty,
    collect,
    inject_sampling_fault,
    make_engine,
    random_prompts,
)
from fake_device import WorkerStream, fake_engine
from kvcore.cache import PENDING_TOKEN_ID, KVCacheManager
from kvcore.config import EngineConfig
from kvcore.engine import Engine
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams

PROMPTS = random_prompts(seed=21, num=12, low=3, high=30)
MIX: list[SamplingParams | BeamSearchParams] = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=5),
    SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3, n=3),
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=1, temperature=0.0),
    SamplingParams(max_tokens=2, temperature=0.7, seed=9, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, seed=4, stop_token_ids=[40, 41, 42, 43]),
    BeamSearchParams(beam_width=2, max_tokens=6),
    SamplingParams(max_tokens=12, temperature=0.7, seed=1, repetition_penalty=1.3),
    SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4),
    SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, n=2),
]


def _summary(out: RequestOutput) -> Any:
    return (out.error, [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs,
                         c.cumulative_logprob) for c in out.outputs])


def _run(engine: Engine, requests: list[tuple[str, list[int], Any]],
         aborts: dict[int, list[str]] | None = None) -> dict[str, Any]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done: dict[str, Any] = {}
    seen: dict[str, list[RequestOutput]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for request_id in (aborts or {}).get(num_steps, []):
            out = engine.abort_request(request_id)
            if out is not None and (whole := collect(seen, out)) is not None:
                done[request_id] = _summary(whole)
        for out in engine.step():
            if (whole := collect(seen, out)) is not None:
                done[out.request_id] = _summary(whole)
        num_steps += 1
    return done


def _requests(prompts: list[list[int]], params: list[Any]) -> list[tuple[str, list[int], Any]]:
    return [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]


def _with_stop_strings(engine: Engine) -> list[tuple[str, list[int], Any]]:
    """The mix plus requests whose stop strings are cut out of their own reference text, so the
    output processor ends them (one step late, with async scheduling)."""
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = _run(engine, [("ref", PROMPTS[0], base), ("ref2", PROMPTS[1], base)])
    stops = [next(c for c in ref[rid][1][0][1][2:] if c.isascii() and c.isprintable())
             for rid in ("ref", "ref2")]
    assert_pool_empty(engine)
    return [*_requests(PROMPTS, MIX),
            ("s0", PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                              stop=[stops[0]])),
            ("s1", PROMPTS[1], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                              stop=[stops[1]], include_stop_str_in_output=True,
                                              n=2))]


@pytest.mark.parametrize("num_blocks", [512, 28], ids=["roomy", "preempting"])
def test_fake_device_outputs_are_identical_on_and_off(tiny_model_dir: Path,
                                                      num_blocks: int) -> None:
    runs = {}
    preemptions = {}
    for name, on, worker in (("sync", False, False), ("off", False, True), ("on", True, True)):
        engine = fake_engine(tiny_model_dir, on, worker, num_blocks=num_blocks,
                             max_num_batched_tokens=48)
        requests = _with_stop_strings(engine)
        runs[name] = _run(engine, requests)
        preemptions[name] = engine.scheduler.num_preemptions
        assert_pool_empty(engine)
    assert runs["on"] == runs["sync"]
    assert runs["off"] == runs["sync"]
    assert all(error is None for error, _ in runs["on"].values())
    reasons = {c[2] for _, choices in runs["on"].values() for c in choices}
    assert reasons == {"stop", "length"}
    if num_blocks == 28:
        assert preemptions["on"] > 0


def test_pending_tokens_are_filled_on_the_device(tiny_model_dir: Path) -> None:
    """With async scheduling each decode step carries the pending token sampled by the step
    before; the fake device refuses a pending id, so finishing at all shows every one was
    filled from the samples. Never past max_tokens: 8 tokens, 8 decode rows at most."""
    engine = fake_engine(tiny_model_dir, True, max_delay_s=0.0)
    runner = engine.core.runner
    real = runner.launch
    pending: list[int] = []

    def launch(out: Any, sample: Any, fill: Any = None) -> Any:
        pending.append(sum(item.token_ids[-1] == PENDING_TOKEN_ID for item in out.scheduled))
        return real(out, sample, fill)

    runner.launch = launch  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = _run(engine, [("a", PROMPTS[2], params)])
    assert pending == [0, 1, 1, 1, 1, 1, 1, 1]  # the prefill, then 7 decodes
    reference = _run(fake_engine(tiny_model_dir, False, False), [("a", PROMPTS[2], params)])
    assert got == reference
    assert_pool_empty(engine)


def test_aborts_mid_flight_free_every_block(tiny_model_dir: Path) -> None:
    reference = _run(fake_engine(tiny_model_dir, False, False), _requests(PROMPTS, MIX))
    engine = fake_engine(tiny_model_dir, True)
    aborted = ["r1", "r2", "r7", "r11"]
    got = _run(engine, _requests(PROMPTS, MIX), aborts={3: aborted[:2], 5: aborted[2:]})
    for request_id, (error, choices) in got.items():
        assert error is None
        if request_id not in aborted:
            assert (error, choices) == reference[request_id]
    for request_id in ("r1", "r2", "r11"):  # partial: a prefix of what they would have been
        # (not r7: an aborted beam search reports its live beams, not the final ones)
        for mine, full in zip(got[request_id][1], reference[request_id][1], strict=True):
            assert full[0][:len(mine[0])] == mine[0]
    assert_pool_empty(engine)
    assert engine.step() == []


def test_a_failed_forward_fails_its_requests_only(tiny_model_dir: Path) -> None:
    """Step 3 fails on the device while step 4 is already launched: step 3's requests fail,
    step 4's other sequences are recomputed, nothing leaks, and a prompt sharing a failed
    step's blocks is not served stale K/V."""
    requests = _requests(PROMPTS[:6], MIX[:6])
    reference = _run(fake_engine(tiny_model_dir, False, False), requests)
    engine = fake_engine(tiny_model_dir, True, fail_calls=(3,), max_num_seqs=3)
    got = _run(engine, requests)
    failed = {rid for rid, (error, _) in got.items() if error is not None}
    assert failed and all(got[rid][0].startswith("forward pass") for rid in failed)
    assert {rid: got[rid] for rid in got if rid not in failed} == {
        rid: reference[rid] for rid in reference if rid not in failed}
    assert_pool_empty(engine)
    again = _run(engine, [(f"again-{rid}", p, q) for rid, p, q in requests if rid in failed])
    assert {rid[len("again-"):]: v for rid, v in again.items()} == {
        rid: reference[rid] for rid in failed}
    assert_pool_empty(engine)


def test_a_step_launched_after_a_failed_one_is_recomputed(tiny_model_dir: Path) -> None:
    """Step 2 (A's first decode) fails while step 3 (A's next decode and C's prefill, C
    sharing A's prompt) is already on the device: A fails, C goes back to waiting and is
    recomputed to the output it has alone; no block leaks."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    prompt_c = PROMPTS[3] + PROMPTS[4]
    reference = _run(fake_engine(tiny_model_dir, False, False), [("C", prompt_c, seeded)])
    engine = fake_engine(tiny_model_dir, True, fail_calls=(2,))
    engine.add_request("A", PROMPTS[3], greedy)
    assert engine.step() == []  # step 1 launched, nothing collected yet
    first = engine.step()  # step 2 launched, step 1 collected: A's first token
    assert [out.request_id for out in first] == ["A"]
    engine.add_request("C", prompt_c, seeded)
    got = {out.request_id: out for out in engine.step()}  # step 3 launched, step 2 failed
    assert got["A"].error is not None and got["A"].error.startswith("forward pass")
    assert engine.scheduler.num_preemptions == 1  # C, rolled back
    assert _run(engine, []) == reference
    assert_pool_empty(engine)


def test_a_failed_sampling_row_fails_its_request_only(tiny_model_dir: Path) -> None:
    requests = _requests(PROMPTS[:6], MIX[:6])
    reference = _run(fake_engine(tiny_model_dir, False, False), requests)
    engine = fake_engine(tiny_model_dir, True)
    calls = []

    def fault(rows: Any) -> None:
        if any(r.params.seed == 5 for r in rows):
            calls.append(1)
            if len(calls) >= 2:  # its second token
                raise RuntimeError("injected")

    inject_sampling_fault(engine, fault)
    got = _run(engine, requests)
    assert got["r1"][0] is not None and got["r1"][0].startswith("sampling")
    assert {k: v for k, v in got.items() if k != "r1"} == {
        k: v for k, v in reference.items() if k != "r1"}
    assert_pool_empty(engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, len(PROMPTS) - 1), st.integers(0, len(MIX) - 1)),
                min_size=1, max_size=8),
       st.sampled_from([24, 64, 512]), st.sampled_from([8, 32, 2048]))
def test_random_request_mixes_are_identical_on_and_off(
        tiny_model_dir: Path, picks: list[tuple[int, int]], num_blocks: int,
        budget: int) -> None:
    requests = [(f"r{i}", PROMPTS[p], MIX[m]) for i, (p, m) in enumerate(picks)]
    outputs = []
    for on in (False, True):
        engine = fake_engine(tiny_model_dir, on, on, max_delay_s=0.0005, num_blocks=num_blocks,
                             max_num_batched_tokens=budget)
        try:
            outputs.append(_run(engine, requests))
        except ValueError as e:  # a mix that can never fit this pool: refused either way
            assert "pool" in str(e)
            return
        assert_pool_empty(engine)
    assert outputs[0] == outputs[1]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, len(MIX) - 1), min_size=2, max_size=7),
       st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), max_size=4))
def test_random_aborts_mid_flight(tiny_model_dir: Path, mix: list[int],
                                  aborts: list[tuple[int, int]]) -> None:
    """Aborted at random steps with async scheduling on: every other request's output is the
    one it has alone with async scheduling off, and every block comes back."""
    requests = [(f"r{i}", PROMPTS[i], MIX[m]) for i, m in enumerate(mix)]
    by_step: dict[int, list[str]] = {}
    for step, i in aborts:
        by_step.setdefault(step, []).append(f"r{i}")
    reference = _run(fake_engine(tiny_model_dir, False, False), requests)
    engine = fake_engine(tiny_model_dir, True, max_delay_s=0.0005)
    got = _run(engine, requests, aborts=by_step)
    aborted = {rid for rids in by_step.values() for rid in rids}
    assert {k: v for k, v in got.items() if k not in aborted} == {
        k: v for k, v in reference.items() if k not in aborted}
    for rid in aborted & set(got):
        if not isinstance(MIX[mix[int(rid[1:])]], BeamSearchParams):
            for mine, full in zip(got[rid][1], reference[rid][1], strict=True):
                assert full[0][:len(mine[0])] == mine[0]
    assert_pool_empty(engine)


def test_tiny_model_greedy_and_seeded_identical_on_and_off(tiny_model_dir: Path) -> None:
    params = [SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.8, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=6, n=2)]
    requests = _requests(PROMPTS[:8], params * 2)
    off = _run(make_engine(tiny_model_dir), requests)
    for stream in (None, WorkerStream()):
        engine = make_engine(tiny_model_dir, async_scheduling=True)
        assert engine.core.async_scheduling
        if stream is not None:
            engine.core.runner.stream = stream
        assert _run(engine, requests) == off
        assert_pool_empty(engine)


def test_default_is_off_on_the_cpu_and_the_flag_is_checked(tiny_model_dir: Path) -> None:
    assert not make_engine(tiny_model_dir).core.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling must be a bool or None"):
        EngineConfig(model=str(tiny_model_dir), async_scheduling="yes")  # type: ignore[arg-type]


def test_the_cli_turns_it_off() -> None:
    import argparse

    from kvcore.cli import generate, serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve._config(parser.parse_args([]), "m").async_scheduling is None
    assert serve._config(parser.parse_args(["--no-async-scheduling"]), "m").async_scheduling \
        is False
    assert serve._config(parser.parse_args(["--async-scheduling"]), "m").async_scheduling
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    assert parser.parse_args(["hi", "--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args(["hi"]).async_scheduling is None


def test_a_block_waiting_for_a_pending_token_is_hashed_once_known() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [5, 6, 7, 8, 9, 10, 11]
    kv.allocate_prefix("a", tokens)
    assert kv.allocate_slots("a", tokens, 7) == []
    assert len(kv._seqs["a"].block_hashes) == 1
    tokens.append(PENDING_TOKEN_ID)  # fills block 1, whose hash needs that token
    assert kv.allocate_slots("a", tokens, 1) == []
    assert len(kv._seqs["a"].block_hashes) == 1
    tokens[-1] = 12
    kv.cache_blocks("a", tokens)
    assert len(kv._seqs["a"].block_hashes) == 2
    kv.free("a")
    assert kv.allocate_prefix("b", [*tokens, 1]) == 8  # the published block serves a hit


@pytest.mark.parametrize("kind", ["plain greedy", "mixed"])
def test_row_sampler_launch_is_call_in_two_halves(kind: str) -> None:
    """RowSampler.launch: the device token ids now, the read-back later, equal to __call__."""
    import numpy as np

    from kvcore.sampling import RowSampler, SamplingRow

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((6, 50)).astype(np.float32)  # (B, V)
    params = [SamplingParams(temperature=0.0)] * 6 if kind == "plain greedy" else [
        SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=3, logprobs=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    rows = [SamplingRow(p, [1, 2], [3], seed=10 + i, position=1)
            for i, p in enumerate(params)]
    sampler = RowSampler([0], 50)
    expected = sampler(logits.copy(), rows)
    token_ids, read = sampler.launch(logits.copy(), rows)
    out = read()
    assert np.array_equal(np.asarray(token_ids), expected.token_ids)
    assert np.array_equal(out.token_ids, expected.token_ids)
    assert out.logprobs == expected.logprobs


def test_tiny_model_fills_pending_tokens_on_its_device(tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """LlamaModel takes the pending ids as an InputFill (a scatter into its device input_ids
    after the upload), not read back into the host batch."""
    from kvcore.model import InputFill

    applied: list[int] = []
    real = InputFill.apply

    def apply(self: InputFill, input_ids: Any) -> None:
        applied.append(len(self.rows))
        real(self, input_ids)

    monkeypatch.setattr(InputFill, "apply", apply)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = _requests(PROMPTS[:3], [params] * 3)
    off = _run(make_engine(tiny_model_dir), requests)
    assert not applied
    engine = make_engine(tiny_model_dir, async_scheduling=True)
    assert _run(engine, requests) == off
    assert applied and sum(applied) == 3 * 5  # every decode row after each first token
    assert_pool_empty(engine)


def test_graphed_half_model_identical_on_and_off(tiny_model_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA-graph path (stand-in capturer, emulated kernels): pending ids scattered into
    the graph's static input buffer after its upload give the synchronous run's tokens."""
    import dataclasses
    import shutil

    if shutil.which("g++") is None:
        pytest.skip("the emulation harness needs g++")
    pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
    from graph_helpers import StandInCapturer, route_kernels_through_emulation
    from kvcore.config import CacheConfig, SchedulerConfig
    from kvcore.model import load_model

    route_kernels_through_emulation(monkeypatch)
    from kvcore.model import InputFill

    applied: list[int] = []
    real = InputFill.apply

    def apply(self: InputFill, input_ids: Any) -> None:
        applied.append(input_ids.shape[0])  # the graph's padded static buffer, or the batch's
        real(self, input_ids)

    monkeypatch.setattr(InputFill, "apply", apply)
    base = EngineConfig(model=str(tiny_model_dir), device="cpu",
                        cache=CacheConfig(block_size=4, num_blocks=128),
                        scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=64))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 3, 9, 5)]
    params.append(SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True))
    requests = _requests(PROMPTS[:5], params)
    outputs = []
    for on in (False, True):
        model = load_model(tiny_model_dir, device="cpu", half=True)
        graphs = model.enable_cuda_graphs(4, 64, 4, StandInCapturer())
        engine = Engine(dataclasses.replace(base, async_scheduling=on), model=model)
        outputs.append(_run(engine, requests))
        assert graphs.num_replays >= 5
        assert_pool_empty(engine)
        assert bool(applied) == on
    assert outputs[0] == outputs[1]
    assert 4 in applied  # a fill into the graph's static input ids (batch size bucket 4)


def test_sliding_window_model_identical_on_and_off(tmp_path: Path) -> None:
    """Mistral's window (16 tokens, blocks of 4): blocks leave the window at launch time, while
    the step that still reads them is on the device (stream order keeps them until then)."""
    from tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "mistral", arch="mistral")
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=2, ignore_eos=True)]
    requests = _requests(PROMPTS[:6], params * 3)
    off = _run(make_engine(model_dir, num_blocks=64), requests)
    for stream in (None, WorkerStream()):
        engine = make_engine(model_dir, num_blocks=64, async_scheduling=True)
        assert engine.kv.sliding_window == 16
        if stream is not None:
            engine.core.runner.stream = stream
        assert _run(engine, requests) == off
        assert_pool_empty(engine)

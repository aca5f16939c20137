"""The xp sampler under NumPy: greedy and logprobs equal to the NumPy reference (tests/), a seeded
row's token independent of the batch (order, size, chunking), the candidate window, bad input."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcore.sampling import SamplingParams, SamplingRow
from kvcore.sampling.rng import gumbel_, row_keys, uniforms_dense
from kvcore.sampling.row_sampler import RowSampler
from kvcore.sampling.xp_sampler import (
    XpSampler,
    _dense_draw,
    _pruned_draw,
    _truncated_draw,
)
from sampling_oracle import Sampler

VOCAB = 300
EOS = (0, 7)


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)


def history(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def every_processor(rng: np.random.Generator, greedy: bool) -> SamplingParams:
    """Random parameters touching every processor the sampler has."""
    return SamplingParams(
        temperature=0.0 if greedy else float(rng.uniform(0.3, 1.5)),
        top_k=None if greedy else int(rng.choice([5, 40, 299])),
        top_p=1.0 if greedy else float(rng.choice([1.0, 0.7, 0.95])),
        min_p=0.0 if greedy else float(rng.choice([0.0, 0.05])),
        logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, VOCAB, 4)},
        min_tokens=int(rng.integers(0, 4)), max_tokens=None,
        stop_token_ids=tuple(int(t) for t in rng.integers(0, VOCAB, 2)),
        ignore_eos=bool(rng.integers(0, 2)),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
        frequency_penalty=float(rng.uniform(-1, 1)), presence_penalty=float(rng.uniform(-1, 1)),
        logprobs=int(rng.choice([0, 3, 5])) if rng.integers(0, 2) else None,
    )


def make_rows(seed: int, num: int, greedy_fraction: float) -> list[SamplingRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num):
        greedy = bool(rng.random() < greedy_fraction)
        rows.append(SamplingRow(every_processor(rng, greedy),
                                history(rng, int(rng.integers(0, 6))),
                                history(rng, int(rng.integers(0, 6))), seed=1000 + i))
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_rows_equal_sampler_with_every_processor(seed: int) -> None:
    rows = make_rows(seed, 24, greedy_fraction=0.6)
    logits = random_logits(len(rows), seed)
    # the reference draws random rows from its own generators (only greedy rows are compared)
    gens = [np.random.default_rng(i) for i in range(len(rows))]
    want = Sampler(EOS)(logits.copy(), rows, gens)
    sampler = XpSampler(EOS, VOCAB)
    got = sampler(logits.copy(), sampler.batch(rows))
    greedy = np.array([r.params.greedy for r in rows])
    assert greedy.sum() >= 8 and (~greedy).sum() >= 4
    assert np.array_equal(got.token_ids[greedy], want.token_ids[greedy])
    # logprobs are of the raw distribution: equal to Sampler's on every row asking, the
    # chosen token's wherever both chose the same token
    for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs, strict=True)):
        assert (a is None) == (b is None)
        if a is None or b is None:
            continue
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-6)
        assert a.token_id == got.token_ids[i]
        if a.token_id == b.token_id:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)


def test_logprobs_equal_float64_reference() -> None:
    rows = make_rows(5, 16, greedy_fraction=0.3)
    rows = [SamplingRow(SamplingParams(**{**_fields(r.params), "logprobs": 4}),
                        r.prompt_token_ids, r.output_token_ids, seed=r.seed) for r in rows]
    logits = random_logits(len(rows), 5)
    raw = logits.astype(np.float64)
    ref = raw - np.log(np.exp(raw - raw.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - raw.max(1, keepdims=True)
    sampler = XpSampler(EOS, VOCAB)
    out = sampler(logits.copy(), sampler.batch(rows))
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id], abs=1e-6)
        best = np.argsort(-ref[i], kind="stable")[:4]
        assert [t for t, _ in lp.top] == best.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], ref[i, best], atol=1e-6)


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)
            if f.init}


def test_plain_greedy_is_one_argmax() -> None:
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [2, 3])] * 5
    logits = random_logits(5, 9)
    sampler = XpSampler(EOS, VOCAB)
    batch = sampler.batch(rows)
    assert batch.plain_greedy
    assert sampler(logits, batch).token_ids.tolist() == logits.argmax(axis=1).tolist()
    assert not sampler.batch(
        [SamplingRow(SamplingParams(temperature=0.0, logprobs=0), [], [])]).plain_greedy


def test_untruncated_row_is_the_gumbel_argmax() -> None:
    """A temperature-only row: argmax(logits / T + gumbel(seed, position)), recomputed here."""
    logits = random_logits(3, 4)
    rows = [SamplingRow(SamplingParams(temperature=t, max_tokens=None), [], [5] * pos,
                        seed=seed) for t, pos, seed in [(0.7, 0, 1), (1.0, 3, 2), (1.9, 11, 3)]]
    sampler = XpSampler(EOS, VOCAB)
    got = sampler(logits.copy(), sampler.batch(rows)).token_ids
    keys = row_keys(np.array([1, 2, 3], dtype=np.uint64), np.array([0, 3, 11]))
    noise = gumbel_(uniforms_dense(keys, VOCAB))
    temps = np.array([0.7, 1.0, 1.9], dtype=np.float32)[:, None]
    assert got.tolist() == (logits / temps + noise).argmax(axis=1).tolist()


def run_request(params: SamplingParams, others: int, prune_noise: bool = True,
                steps: int = 12) -> list[int]:
    """Decode `steps` tokens of one seeded request at a varying place in a batch of `others`
    unrelated requests (other parameters, other seeds, some greedy)."""
    rng = np.random.default_rng(others)
    other_rows = make_rows(others + 50, others, greedy_fraction=0.3)
    sampler = XpSampler(EOS, VOCAB, prune_noise=prune_noise)
    out: list[int] = []
    for step in range(steps):
        pos = (step * 7 + others) % (others + 1)
        logits = random_logits(others + 1, 100 + step)  # (B, V) noise for the others
        logits[pos] = random_logits(1, 1000 + step)[0]  # the request's own logits
        rows = list(other_rows)
        rng.shuffle(rows)  # a different order every step
        rows.insert(pos, SamplingRow(params, [1, 2], list(out), seed=1234))
        out.append(int(sampler(logits, sampler.batch(rows)).token_ids[pos]))
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=None),
    SamplingParams(temperature=0.8, top_p=0.9, min_p=0.02, max_tokens=None),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, max_tokens=None,
                   presence_penalty=0.5, repetition_penalty=1.2, logit_bias={3: 2.0}),
])
def test_seeded_row_is_independent_of_the_batch(params: SamplingParams) -> None:
    alone = run_request(params, others=0)
    assert run_request(params, others=5) == alone
    assert run_request(params, others=31) == alone
    assert run_request(params, others=9, prune_noise=False) == alone  # full noise
    assert len(set(alone)) > 3  # it really samples


def test_pruned_noise_draws_what_the_full_noise_draws() -> None:
    """Pruning the noise to the tokens that can still win changes no token: wide and narrow
    logits, masked tokens, exact ties, a row with a single live token, several temperatures."""
    rng = np.random.default_rng(21)
    rows = []
    for i in range(60):
        scale = 40.0 if i >= 42 else [0.3, 3.0, 12.0][i % 3]  # the last 3 chunks of 7: peaked
        rows.append(rng.standard_normal(VOCAB) * scale)
    x = np.array(rows, dtype=np.float32)  # (60, V)
    x[5, :] = -np.inf
    x[5, 17] = 1.0  # one live token
    x[7, ::2] = -np.inf  # half masked
    x[9, :] = 0.25  # all tied
    x[11, 40:60] = x[11].max() + 1  # a tied top group
    sampler = XpSampler(EOS, VOCAB)
    sampler.noise_rows = 7  # chunks of 7 rows, each pruned or not on its own
    for position in range(6):
        keys = row_keys(np.arange(60, dtype=np.uint64) * np.uint64(7919),
                        np.full(60, position))
        full = _dense_draw(x.copy(), keys)
        assert np.array_equal(sampler._untruncated_draw(x.copy(), keys), full)
        pruned = _pruned_draw(x.copy(), keys, max_live=1.0)
        assert np.array_equal(pruned, full)
        y = x.copy()
        assert _pruned_draw(y, keys, max_live=0.01) is None and np.array_equal(y, x)
        assert full[5] == 17 and full[7] % 2 == 1 and 40 <= full[11] < 60
        # the sampler pruned the peaked chunks and not the others
        assert _pruned_draw(x[42:49].copy(), keys[42:49]) is not None
        assert _pruned_draw(x[:7].copy(), keys[:7]) is None


def test_truncated_draw_window_growth_equals_a_full_sort() -> None:
    """Nuclei wider than the first window (flat logits, top_p near 1, large top_k) resolve to the
    same token as a window of the whole vocabulary, and only kept tokens are drawn."""
    vocab = 3000
    rng = np.random.default_rng(8)
    x = (rng.standard_normal((40, vocab)) * 0.5).astype(np.float32)  # (40, V) flat-ish
    x[::5, 100:] = -np.inf  # some rows whose tail is masked (min_p did it)
    top_k = np.array([vocab, 10, 700, vocab] * 10, dtype=np.int64)
    top_p = np.array([0.99, 1.0, 0.9, 0.3] * 10)
    keys = row_keys(np.arange(40, dtype=np.uint64), np.zeros(40, dtype=np.int64))
    small = _truncated_draw(x.copy(), keys, top_k, top_p, max_top_k=700, window=16)
    full = _truncated_draw(x.copy(), keys, top_k, top_p, max_top_k=700, window=vocab)
    assert np.array_equal(small, full)
    for i in range(40):  # the drawn token is inside the row's top-k / top-p set
        order = np.argsort(-x[i], kind="stable")
        probs = np.exp(x[i, order].astype(np.float64) - x[i].max())
        probs[top_k[i]:] = 0
        above = (np.cumsum(probs) - probs) / probs.sum()
        kept = order[: max(int((above < top_p[i]).sum()), 1)] if top_p[i] < 1 else \
            order[probs > 0]
        assert small[i] in kept


def test_float16_logits_are_upcast() -> None:
    rows = [SamplingRow(SamplingParams(temperature=0.9, top_k=50), [], [], seed=s)
            for s in range(4)]
    logits = random_logits(4, 3).astype(np.float16)
    sampler = XpSampler(EOS, VOCAB)
    want = sampler(logits.astype(np.float32), sampler.batch(rows)).token_ids
    assert np.array_equal(sampler(logits, sampler.batch(rows)).token_ids, want)


def test_bad_input_raises() -> None:
    sampler = XpSampler(EOS, VOCAB)
    with pytest.raises(ValueError, match="needs a seed"):
        sampler.batch([SamplingRow(SamplingParams(), [], [])])
    batch = sampler.batch([SamplingRow(SamplingParams(), [], [], seed=1)])
    with pytest.raises(ValueError, match="float32"):
        sampler(np.ones((1, VOCAB), dtype=np.float64), batch)
    with pytest.raises(ValueError, match="B=1"):
        sampler(np.ones((2, VOCAB), dtype=np.float32), batch)
    with pytest.raises(ValueError, match="logit_bias holds token id 300"):
        sampler.batch([SamplingRow(SamplingParams(logit_bias={300: 1.0}), [], [], seed=1)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sampler.batch([SamplingRow(SamplingParams(repetition_penalty=1.1), [400], [],
                                   seed=1)])
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        XpSampler(EOS, 0)
    with pytest.raises(ValueError, match="batch.vocab_size"):
        XpSampler(EOS, 10)(np.ones((1, 10), dtype=np.float32), batch)


class _OtherNamespace(types.ModuleType):
    """NumPy under another name: the sampler takes its device (CuPy) branches (full noise, the
    whole batch at once), which CI can then run."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)


def test_device_branches_sample_what_the_cpu_branches_sample() -> None:
    rows = make_rows(3, 40, greedy_fraction=0.3)
    logits = random_logits(len(rows), 3)
    cpu = XpSampler(EOS, VOCAB)
    device = XpSampler(EOS, VOCAB, xp=_OtherNamespace("other"))
    assert cpu.prune_noise and not device.prune_noise and device.noise_rows is None
    want = cpu(logits.copy(), cpu.batch(rows))
    got = device(logits.copy(), device.batch(rows))
    assert np.array_equal(got.token_ids, want.token_ids)
    assert got.logprobs == want.logprobs


def test_bench_sampler_runs_and_validates() -> None:
    """tools/bench_sampler.py (validation first, then the side-by-side table) on a small case."""
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, str(root / "tools" / "bench_sampler.py"),
                             "--batch-sizes", "3", "--vocab", "500", "--repeats", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[:2] for line in lines[2:]] == [["greedy", "3"], ["top_p", "3"],
                                                        ["temperature", "3"]]


def test_row_sampler_plain_greedy_shortcut_equals_the_batch_path() -> None:
    """RowSampler answers an all-plain-greedy step with one argmax and no SamplingBatch; any
    other row (a processor, logprobs, a random row) takes the full xp sampler."""
    rng = np.random.default_rng(31)
    logits = rng.standard_normal((6, VOCAB)).astype(np.float32)  # (6, V)
    plain = [SamplingRow(SamplingParams(temperature=0.0), [1], [2]) for _ in range(6)]
    rows_sampler = RowSampler(EOS, VOCAB)
    got = rows_sampler(logits.copy(), plain)
    xp_sampler = XpSampler(EOS, VOCAB)
    want = xp_sampler(logits.copy(), xp_sampler.batch(plain))
    assert got.token_ids.tolist() == want.token_ids.tolist() == logits.argmax(1).tolist()
    assert got.logprobs == [None] * 6
    mixed = [*plain[:5], SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], [2])]
    out = rows_sampler(logits.copy(), mixed)
    assert out.logprobs[5] is not None and out.logprobs[5].token_id == int(logits[5].argmax())
    with pytest.raises(ValueError, match="logits must be"):
        rows_sampler(logits[:5].copy(), plain)

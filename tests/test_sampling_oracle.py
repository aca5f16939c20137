"""The NumPy reference sampler (the oracle of the xp sampler tests): seeded determinism whatever
the batch, empirical distributions, greedy, logprobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcore.sampling import SamplingParams, SamplingRow
from sampling_oracle import Sampler, draw, make_generator

VOCAB = 64
EOS = (0,)


def step_logits(step: int, rows: int, salt: int) -> np.ndarray:
    """Fresh random logits per step; `salt` differs per request."""
    rng = np.random.default_rng([step, salt])
    return (rng.standard_normal((rows, VOCAB)) * 2).astype(np.float32)  # (rows, V)


def run_request(seed: int, params: SamplingParams, others: int, steps: int = 24) -> list[int]:
    """Decode `steps` tokens of one seeded request at a varying position inside a batch of
    `others` unrelated requests (different params, own unseeded generators)."""
    engine_seeds = np.random.SeedSequence(others)
    rng = np.random.default_rng(others)
    other_params = [SamplingParams(temperature=float(rng.uniform(0.3, 1.5)),
                                   top_k=int(rng.integers(2, 30)), max_tokens=None)
                    for _ in range(others)]
    other_gens = [make_generator(None, engine_seeds) for _ in range(others)]
    generator = make_generator(seed, engine_seeds)
    sampler = Sampler(EOS)
    out: list[int] = []
    for step in range(steps):
        pos = (step * 7 + others) % (others + 1)
        batch = step_logits(step, others + 1, salt=99)  # (B, V) noise for the others
        batch[pos] = step_logits(step, 1, salt=seed)[0]  # the request's own logits
        rows = [SamplingRow(other_params[i], [1, 2], []) for i in range(others)]
        rows.insert(pos, SamplingRow(params, [1, 2], out))
        gens = [*other_gens[:pos], generator, *other_gens[pos:]]
        out.append(int(sampler(batch, rows, gens).token_ids[pos]))
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=None),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, max_tokens=None,
                   presence_penalty=0.5, repetition_penalty=1.2),
])
def test_seed_gives_same_output_whatever_the_batch(params: SamplingParams) -> None:
    alone = run_request(1234, params, others=0)
    assert run_request(1234, params, others=5) == alone
    assert run_request(1234, params, others=31) == alone
    assert run_request(4321, params, others=0) != alone  # the seed matters


def test_unseeded_generators_come_from_the_engine_seed_sequence() -> None:
    a = [make_generator(None, np.random.SeedSequence(7)).random() for _ in range(2)]
    seq = np.random.SeedSequence(7)
    b = [make_generator(None, seq).random() for _ in range(2)]
    assert a[0] == a[1] == b[0] != b[1]  # fresh spawns differ; same engine seed reproduces
    assert make_generator(-1, seq).random() == make_generator(2**64 - 1, seq).random()


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    total = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was sampled"
    expected = probs[support] * total
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


DISTRIBUTIONS: list[dict[str, Any]] = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.7, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.2, "min_p": 0.08},
    {"temperature": 1.0, "top_k": 8, "top_p": 0.9, "min_p": 0.01},
    {"temperature": 1.0, "top_k": 8, "top_p": 0.8, "min_p": 0.05},
]


@pytest.mark.parametrize("params", DISTRIBUTIONS, ids=lambda p: ",".join(p))
def test_empirical_distribution(params: dict[str, Any]) -> None:
    vocab, draws = 12, 30000
    rng = np.random.default_rng(3)
    base = (rng.standard_normal(vocab) * 0.8).astype(np.float32)  # (V,)
    # expected distribution, independently: float64 from the definitions
    x = base.astype(np.float64) / params["temperature"]
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.ones(vocab, dtype=bool)
    if "min_p" in params:
        keep &= p >= params["min_p"] * p.max()
    if "top_k" in params:
        kept = np.sort(x[keep])[::-1]
        keep &= x >= kept[min(params["top_k"], len(kept)) - 1]
    if "top_p" in params:
        q = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
        order = np.argsort(-q)
        above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        keep[order[above >= params["top_p"]]] = False
    expected = np.where(keep, p, 0.0)
    expected /= expected.sum()

    generator = make_generator(2024, np.random.SeedSequence(0))
    sp = SamplingParams(max_tokens=None, **params)
    rows = [SamplingRow(sp, [], [])] * draws
    logits = np.tile(base, (draws, 1))  # (draws, V)
    tokens = Sampler(EOS)(logits, rows, [generator] * draws).token_ids  # one draw per row
    stat, dof = chi_square(np.bincount(tokens, minlength=vocab), expected)
    # a fixed seed makes this deterministic; the bound is ~mean + 6 standard deviations
    assert stat < dof + 6 * np.sqrt(2 * max(dof, 1)), (stat, dof, expected)


@pytest.mark.parametrize("vocab", [1100, 2100])
def test_draw_across_blocks(vocab: int) -> None:
    """The two-level search (blocks of 1024, the last one partial) samples the exact
    distribution: mass on block edges, in the partial last block, and nowhere else."""
    hot = np.array([0, 5, 1023, 1024, vocab - 2, vocab - 1])
    logits = np.full(vocab, -np.inf, dtype=np.float32)  # (V,)
    logits[hot] = np.linspace(-1.0, 1.0, len(hot), dtype=np.float32)
    draws = 4000
    tokens = draw(np.tile(logits, (draws, 1)),  # (draws, V)
                  [make_generator(77, np.random.SeedSequence(0))] * draws)
    p = np.zeros(vocab)
    p[hot] = np.exp(np.linspace(-1.0, 1.0, len(hot)))
    stat, dof = chi_square(np.bincount(tokens, minlength=vocab), p / p.sum())
    assert stat < dof + 6 * np.sqrt(2 * dof), stat


def test_draw_detects_a_wrong_distribution() -> None:
    """The chi-square check above has power: sampling a shifted distribution fails it."""
    vocab, draws = 12, 30000
    logits = np.tile(np.linspace(-1, 1, vocab, dtype=np.float32), (draws, 1))  # (draws, V)
    tokens = draw(logits * 1.1, [make_generator(5, np.random.SeedSequence(0))] * draws)
    p = np.exp(np.linspace(-1, 1, vocab))
    stat, dof = chi_square(np.bincount(tokens, minlength=vocab), p / p.sum())
    assert stat > dof + 6 * np.sqrt(2 * dof)


def test_greedy_rows_take_the_argmax_of_processed_logits() -> None:
    rng = np.random.default_rng(11)
    logits = rng.standard_normal((3, VOCAB)).astype(np.float32)  # (3, V)
    best = int(logits[0].argmax())
    second = int(np.argsort(logits[0])[-2])
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, presence_penalty=2.0), [], [best]),
        SamplingRow(SamplingParams(temperature=0.5, top_k=1), [], []),
        SamplingRow(SamplingParams(temperature=0.0, logit_bias={5: 100.0}), [], []),
    ]
    want_row0 = best if logits[0, best] - 2.0 > logits[0, second] else second
    want = [want_row0, int(logits[1].argmax()), 5]
    assert Sampler(EOS)(logits.copy(), rows).token_ids.tolist() == want


def test_min_tokens_blocks_eos_until_reached() -> None:
    logits = np.full((2, VOCAB), -5.0, dtype=np.float32)  # (2, V)
    logits[:, 0] = 10.0  # EOS is by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=3)
    rows = [SamplingRow(params, [], [4, 5]), SamplingRow(params, [], [4, 5, 6])]
    assert Sampler(EOS)(logits, rows).token_ids[0] != 0
    assert Sampler(EOS)(logits, rows).token_ids[1] == 0


def test_logprobs_are_raw_log_softmax_with_top_k() -> None:
    rng = np.random.default_rng(12)
    logits = (rng.standard_normal((3, VOCAB)) * 3).astype(np.float32)  # (3, V)
    raw = logits.astype(np.float64)
    ref = raw - np.log(np.exp(raw).sum(axis=1, keepdims=True))
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=5, logit_bias={9: 50.0}), [], []),
        SamplingRow(SamplingParams(), [], []),
        SamplingRow(SamplingParams(temperature=0.3, top_k=3, logprobs=0), [], []),
    ]
    gens = [None, make_generator(1, np.random.SeedSequence(0)),
            make_generator(2, np.random.SeedSequence(0))]
    out = Sampler(EOS)(logits.copy(), rows, gens)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert first is not None and first.token_id == 9 == out.token_ids[0]
    assert first.logprob == pytest.approx(ref[0, 9], abs=1e-6)  # raw: the bias is not in it
    want_top = np.argsort(-ref[0])[:5]
    assert [t for t, _ in first.top] == want_top.tolist()
    np.testing.assert_allclose([v for _, v in first.top], ref[0, want_top], atol=1e-6)
    third = out.logprobs[2]
    assert third is not None and third.top == ()
    assert third.logprob == pytest.approx(ref[2, out.token_ids[2]], abs=1e-6)


def test_bad_input_raises() -> None:
    rows = [SamplingRow(SamplingParams(), [], [])]
    with pytest.raises(ValueError, match="needs a generator"):
        Sampler(EOS)(np.ones((1, VOCAB), dtype=np.float32), rows)
    with pytest.raises(ValueError, match="float32"):
        Sampler(EOS)(np.ones((1, VOCAB), dtype=np.float64), rows)
    with pytest.raises(ValueError, match="B=1"):
        Sampler(EOS)(np.ones((2, VOCAB), dtype=np.float32), rows)

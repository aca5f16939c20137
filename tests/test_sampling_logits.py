"""Logits processors against an independent, per-row float64 reimplementation on random logits."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvcore.sampling import SamplingParams, SamplingRow
from kvcore.sampling import logits as lp
from sampling_oracle import process_logits

VOCAB = 300
EOS = (2, 7)


def ref_process(row: np.ndarray, p: SamplingParams, prompt: list[int],
                output: list[int]) -> np.ndarray:
    """The whole pipeline for one row, written from the definitions, in float64."""
    x = row.astype(np.float64)
    for token_id, bias in (p.logit_bias or {}).items():
        x[token_id] += bias
    if len(output) < p.min_tokens:
        for token_id in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            x[token_id] = -np.inf
    if p.repetition_penalty != 1.0:
        for token_id in set(prompt) | set(output):
            v = x[token_id]
            x[token_id] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for token_id, count in Counter(output).items():
        x[token_id] -= p.frequency_penalty * count + p.presence_penalty
    if p.greedy:
        return x
    x = x / p.temperature
    if p.min_p > 0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        x[probs < p.min_p * probs.max()] = -np.inf
    if p.top_k is not None:
        kth = np.sort(x)[::-1][min(p.top_k, len(x)) - 1]
        x[x < kth] = -np.inf
    if p.top_p < 1.0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        mass_above = 0.0
        for token_id in np.argsort(-probs, kind="stable"):
            # keep a token while the mass of the tokens ranked above it is still below top_p
            if mass_above >= p.top_p:
                x[token_id] = -np.inf
            mass_above += probs[token_id]
    return x


Case = tuple[SamplingParams, list[int], list[int]]  # params, prompt ids, output ids


def random_case(rng: np.random.Generator, **params: Any) -> Case:
    prompt = rng.integers(0, VOCAB, size=int(rng.integers(1, 40))).tolist()
    output = rng.integers(0, VOCAB, size=int(rng.integers(0, 30))).tolist()
    output += output[: len(output) // 2]  # repeats, so counts above 1 occur
    return SamplingParams(max_tokens=None, **params), prompt, output


def check_rows(logits: np.ndarray, cases: list[Case]) -> None:
    rows = [SamplingRow(p, prompt, output)
            for p, prompt, output in cases]
    got = logits.copy()
    greedy = process_logits(got, rows, EOS)
    for i, (p, prompt, output) in enumerate(cases):
        want = ref_process(logits[i], p, prompt, output)
        assert greedy[i] == p.greedy
        np.testing.assert_array_equal(np.isneginf(got[i]), np.isneginf(want), err_msg=f"row {i}")
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=2e-6, atol=2e-6,
                                   err_msg=f"row {i}: {p}")


SINGLE_PROCESSORS: list[dict[str, Any]] = [
    {"logit_bias": {3: 5.0, 250: -100.0, 17: 0.5}},
    {"min_tokens": 40, "stop_token_ids": (11, 12)},
    {"min_tokens": 40, "stop_token_ids": (11,), "ignore_eos": True},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"frequency_penalty": 0.8},
    {"presence_penalty": -1.5},
    {"frequency_penalty": -0.4, "presence_penalty": 1.1},
    {"temperature": 0.0, "repetition_penalty": 1.5, "presence_penalty": 0.5},
    {"temperature": 0.35},
    {"temperature": 3.0},
    {"min_p": 0.1},
    {"min_p": 0.5, "temperature": 2.0},
    {"top_k": 1},
    {"top_k": 7},
    {"top_k": 400},
    {"top_p": 0.5},
    {"top_p": 0.95, "temperature": 0.5},
    {"top_p": 1e-6},
]


@pytest.mark.parametrize("params", SINGLE_PROCESSORS, ids=lambda p: ",".join(p))
def test_each_processor_matches_reference(params: dict[str, Any]) -> None:
    rng = np.random.default_rng(zlib.crc32(repr(params).encode()))  # stable across runs
    logits = (rng.standard_normal((4, VOCAB)) * 3).astype(np.float32)  # (B, V)
    check_rows(logits, [random_case(rng, **params) for _ in range(4)])


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0, 6.0])
def test_top_p_window_growth_matches_reference(scale: float) -> None:
    """Nuclei from a handful of tokens to most of a 5000-token vocabulary: the search window
    (128, then x8) is resolved at every size, including the full-sort fallback."""
    rng = np.random.default_rng(int(scale * 100))
    logits = (rng.standard_normal((6, 5000)) * scale).astype(np.float32)  # (B, V)
    cases = [random_case(rng, top_p=p) for p in (0.05, 0.3, 0.6, 0.9, 0.99, 0.999)]
    check_rows(logits, cases)


def random_params(rng: np.random.Generator) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if rng.random() < 0.3:
        params["temperature"] = 0.0
    elif rng.random() < 0.8:
        params["temperature"] = float(rng.uniform(0.2, 2.0))
    if rng.random() < 0.4:
        params["top_k"] = int(rng.integers(1, 50))
    if rng.random() < 0.4:
        params["top_p"] = float(rng.uniform(0.1, 1.0))
    if rng.random() < 0.3:
        params["min_p"] = float(rng.uniform(0.0, 0.3))
    if rng.random() < 0.4:
        params["repetition_penalty"] = float(rng.uniform(0.5, 2.0))
    if rng.random() < 0.4:
        params["frequency_penalty"] = float(rng.uniform(-2, 2))
        params["presence_penalty"] = float(rng.uniform(-2, 2))
    if rng.random() < 0.3:
        keys = rng.choice(VOCAB, size=5, replace=False)
        params["logit_bias"] = {int(k): float(rng.uniform(-100, 100)) for k in keys}
    if rng.random() < 0.3:
        params["min_tokens"] = int(rng.integers(0, 50))
        params["stop_token_ids"] = tuple(int(t) for t in rng.integers(0, VOCAB, size=2))
    return params


@pytest.mark.parametrize("seed", range(6))
def test_mixed_batch_matches_reference_row_by_row(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    batch = 16
    logits = (rng.standard_normal((batch, VOCAB)) * 2.5).astype(np.float32)  # (B, V)
    check_rows(logits, [random_case(rng, **random_params(rng)) for _ in range(batch)])


def test_token_pairs_counts_per_row() -> None:
    rng = np.random.default_rng(5)
    lists = [rng.integers(0, 20, size=n).tolist() for n in (0, 7, 30, 1)]
    rows = np.array([4, 0, 9, 2])
    pair_rows, pair_tokens, counts = lp.token_pairs(lists, rows, 20)
    got = {(int(r), int(t)): int(c) for r, t, c in zip(pair_rows, pair_tokens, counts, strict=True)}
    want = {(int(r), t): c for r, tokens in zip(rows, lists, strict=True)
            for t, c in Counter(tokens).items()}
    assert got == want
    with pytest.raises(ValueError, match="token id 20"):
        lp.token_pairs([[1, 20]], np.array([0]), 20)


def test_top_k_keeps_ties_and_top_p_keeps_best() -> None:
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 2.0]], dtype=np.float32)  # (1, 5)
    lp.apply_top_k(logits, np.array([0]), np.array([2]))
    np.testing.assert_array_equal(np.isfinite(logits[0]), [False, True, True, False, False])
    peaked = np.array([[0.0, 10.0, 0.0]], dtype=np.float32)  # (1, 3)
    lp.apply_top_p(peaked, np.array([0]), np.array([1e-9]))
    np.testing.assert_array_equal(np.isfinite(peaked[0]), [False, True, False])


def test_log_softmax_matches_reference() -> None:
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 50)) * 4).astype(np.float32)  # (3, 50)
    x[1, 4] = -np.inf
    got = lp.log_softmax(x)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    assert np.isneginf(got[1, 4])


def test_out_of_vocab_ids_name_the_parameter() -> None:
    logits = np.zeros((1, 10), dtype=np.float32) + np.arange(10, dtype=np.float32)  # (1, 10)
    row = SamplingRow(SamplingParams(logit_bias={10: 1.0}), [1], [])
    with pytest.raises(ValueError, match="logit_bias holds token id 10"):
        process_logits(logits, [row], EOS)
    row = SamplingRow(SamplingParams(min_tokens=3, stop_token_ids=(12,)), [1], [])
    with pytest.raises(ValueError, match="stop_token_ids holds token id 12"):
        process_logits(logits, [row], EOS)

"""The xp sampler's draws follow the processed distribution: chi-square over 10,000 draws (one
seed per row) per setting, against float64 NumPy from the definitions, and the check has power."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcore.sampling import SamplingParams, SamplingRow
from kvcore.sampling.xp_sampler import XpSampler

VOCAB = 12
DRAWS = 10_000
EOS = (0,)
PROMPT = [3, 3, 9]
OUTPUT = [4, 9, 9, 1]


def expected(base: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    """The distribution a row with parameters `p` must sample, in float64 from the definitions:
    bias, min_tokens, repetition (prompt + output), frequency/presence (output), temperature,
    min_p, top_k, top_p (vLLM: keep while the mass above is < top_p)."""
    x = base.astype(np.float64)
    for token, bias in (p.get("logit_bias") or {}).items():
        x[token] += bias
    if len(OUTPUT) < p.get("min_tokens", 0):
        x[list(EOS)] = -np.inf
    rep = p.get("repetition_penalty", 1.0)
    for token in set(PROMPT + OUTPUT):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(OUTPUT):
        x[token] -= (p.get("frequency_penalty", 0.0) * OUTPUT.count(token)
                     + p.get("presence_penalty", 0.0))
    x /= p.get("temperature", 1.0)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = probs > 0
    if "min_p" in p:
        keep &= probs >= p["min_p"] * probs.max()
    if "top_k" in p:
        kept = np.sort(x[keep])[::-1]
        keep &= x >= kept[min(p["top_k"], len(kept)) - 1]
    if "top_p" in p:
        q = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
        order = np.argsort(-q)
        above = np.concatenate([[0.0], np.cumsum(q[order])[:-1]])
        keep[order[above >= p["top_p"]]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def draw(base: np.ndarray, params: SamplingParams, seed_offset: int = 0) -> np.ndarray:
    """DRAWS tokens: one row per draw, each with its own seed, all at the same position."""
    rows = [SamplingRow(params, PROMPT, OUTPUT, seed=seed_offset + i) for i in range(DRAWS)]
    sampler = XpSampler(EOS, VOCAB)
    logits = np.tile(base, (DRAWS, 1))  # (DRAWS, V)
    return sampler(logits, sampler.batch(rows)).token_ids


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    counts = np.bincount(tokens, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was sampled"
    want = probs[support] * counts.sum()
    return float(((counts[support] - want) ** 2 / want).sum()), int(support.sum()) - 1


SETTINGS: list[dict[str, Any]] = [
    {},
    {"temperature": 0.6},
    {"temperature": 1.7, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.2, "min_p": 0.08},
    {"temperature": 1.0, "top_k": 8, "top_p": 0.9, "min_p": 0.01},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.4, "presence_penalty": -0.3},
    {"temperature": 0.8, "logit_bias": {5: 1.5, 6: -2.0}, "min_tokens": 6, "top_p": 0.95,
     "repetition_penalty": 0.7},
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda p: ",".join(p) or "plain")
def test_empirical_distribution(setting: dict[str, Any]) -> None:
    base = (np.random.default_rng(3).standard_normal(VOCAB) * 0.8).astype(np.float32)  # (V,)
    probs = expected(base, setting)
    stat, dof = chi_square(draw(base, SamplingParams(max_tokens=None, **setting)), probs)
    # fixed seeds make this deterministic; the bound is ~ mean + 6 standard deviations
    assert stat < dof + 6 * np.sqrt(2 * max(dof, 1)), (stat, dof, probs)


def test_the_check_detects_a_wrong_distribution() -> None:
    """Power: draws at temperature 1.0 fail against the temperature-1.25 distribution."""
    base = np.linspace(-1, 1, VOCAB, dtype=np.float32)  # (V,)
    tokens = draw(base, SamplingParams(max_tokens=None), seed_offset=50_000)
    stat, dof = chi_square(tokens, expected(base, {"temperature": 1.25}))
    assert stat > dof + 6 * np.sqrt(2 * dof)
    stat, dof = chi_square(tokens, expected(base, {}))
    assert stat < dof + 6 * np.sqrt(2 * dof)

"""The packed token bitmask on logits: the numba loop, the array-op form and llguidance's own
NumPy reference agree; a masked row's draw stays inside its mask."""

from __future__ import annotations

import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace

from kvcore.kernels.token_mask import apply_token_bitmask, apply_token_bitmask_xp
from kvcore.sampling import SamplingParams, SamplingRow, XpSampler


@pytest.mark.parametrize("vocab_size", [259, 4096, 49_152 + 5])
def test_numba_and_xp_match_llguidance(vocab_size: int) -> None:
    rng = np.random.default_rng(vocab_size)
    num_words = (vocab_size + 31) // 32
    logits = rng.standard_normal((6, vocab_size), dtype=np.float32)
    masks = rng.integers(-2**31, 2**31, size=(3, num_words), dtype=np.int64).astype(np.int32)
    masks[1] = -1  # a row where every token is allowed
    rows = np.array([4, 0, 2], dtype=np.int64)
    expected = logits.copy()
    sub = expected[rows]
    apply_token_bitmask_inplace(sub, masks)
    expected[rows] = sub
    fast, ref = logits.copy(), logits.copy()
    apply_token_bitmask(fast, rows, masks)
    apply_token_bitmask_xp(ref, rows, masks)
    np.testing.assert_array_equal(fast, expected)
    np.testing.assert_array_equal(ref, expected)
    np.testing.assert_array_equal(fast[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask


def test_shape_and_dtype_are_checked() -> None:
    logits = np.zeros((2, 100), np.float32)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, np.array([0]), np.zeros((1, 4), np.int64))
    with pytest.raises(ValueError, match="32 W >= V"):
        apply_token_bitmask(logits, np.array([0]), np.zeros((1, 3), np.int32))


def test_sampler_draws_inside_the_mask() -> None:
    vocab_size = 300
    sampler = XpSampler([2], vocab_size)
    allowed = [7, 42, 299]
    mask = np.zeros((vocab_size + 31) // 32, np.int32)
    for t in allowed:
        mask[t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2**31)
    rows = [SamplingRow(SamplingParams(temperature=t, seed=s, logprobs=1), (), (), s,
                        0, mask) for s, t in ((1, 0.0), (2, 1.0), (3, 2.0))]
    rows.append(SamplingRow(SamplingParams(temperature=1.0, seed=4), (), (), 4, 0))
    logits = np.random.default_rng(0).standard_normal((4, vocab_size), dtype=np.float32)
    raw = logits.copy()
    out = sampler(logits, sampler.batch(rows))
    assert all(int(t) in allowed for t in out.token_ids[:3])
    lp = out.logprobs[0]
    assert lp is not None and np.isfinite(lp.logprob)  # raw logprobs, before the mask
    assert lp.logprob == pytest.approx(float(raw[0, lp.token_id] - np.log(np.exp(
        raw[0].astype(np.float64)).sum())), rel=1e-5)

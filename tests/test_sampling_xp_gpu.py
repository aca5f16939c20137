"""On a GPU: the xp sampler under CuPy draws the noise NumPy draws, bit for bit, and samples the
tokens (and logprobs) NumPy samples from the same fp32 logits. Marked `gpu`; skipped without a
usable CUDA device (run by tools/gpu_check.sh)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcore.device import cuda_available
from kvcore.sampling.rng import row_keys, uniforms, uniforms_dense
from kvcore.sampling.xp_sampler import XpSampler
from test_sampling_xp_sampler import EOS, VOCAB, make_rows, random_logits

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]


def test_noise_equals_numpy_bit_for_bit() -> None:
    import cupy

    seeds = np.arange(16, dtype=np.uint64) * np.uint64(2**61 + 3)  # (16,)
    positions = np.arange(16) * 1000
    host_keys = row_keys(seeds, positions)
    dev_keys = row_keys(cupy.asarray(seeds), cupy.asarray(positions))
    assert np.array_equal(host_keys, dev_keys.get())
    assert np.array_equal(uniforms_dense(host_keys, 49152), uniforms_dense(dev_keys, 49152).get())
    ids = np.random.default_rng(1).integers(0, 49152, size=(16, 300))  # (16, 300)
    assert np.array_equal(uniforms(host_keys, ids), uniforms(dev_keys, cupy.asarray(ids)).get())


@pytest.mark.parametrize("seed", [0, 1])
def test_tokens_and_logprobs_equal_numpy(seed: int) -> None:
    import cupy

    rows = make_rows(seed, 48, greedy_fraction=0.3)
    logits = random_logits(len(rows), seed)
    host = XpSampler(EOS, VOCAB)
    dev = XpSampler(EOS, VOCAB, xp=cupy)
    want = host(logits.copy(), host.batch(rows))
    got = dev(cupy.asarray(logits), dev.batch(rows))
    assert np.array_equal(got.token_ids, want.token_ids)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)

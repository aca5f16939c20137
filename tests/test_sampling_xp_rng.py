"""The counter-based generator: SplitMix64 known answers, a pure-Python reference of the whole
(seed, position, token) -> uniform -> Gumbel path, bit for bit, and the quality of its output."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcore.sampling import rng
from kvcore.sampling.rng import (
    _halves_to_uniform,
    gumbel_,
    make_seed,
    mix,
    row_keys,
    uniforms,
    uniforms_dense,
)
from kvcore.sampling.xp_sampler import NOISE_MAX

M64 = 2**64 - 1
# SplitMix64 (Steele, Lea & Flood; Vigna's splitmix64.c), written out independently in Python ints
G = 0x9E3779B97F4A7C15


def ref_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def ref_uniform(seed: int, position: int, token_id: int) -> float:
    """The documented recipe in plain integers: key, the token pair's 64 bits, the half, 23 bits."""
    key = ref_mix((ref_mix((seed + G) & M64) + (position + 1) * G) & M64)
    bits = ref_mix((key + ((token_id >> 1) + 1) * G) & M64)
    half = bits >> 32 if token_id & 1 else bits & 0xFFFFFFFF
    return (2 * (half >> 9) + 1) / 2**24


def test_mix_is_splitmix64() -> None:
    # the reference generator's first outputs for seed 1234567 (splitmix64.c, Rosetta Code)
    state = np.uint64(1234567) + np.arange(1, 6, dtype=np.uint64) * np.uint64(G)
    assert mix(state).tolist() == [6457827717110365317, 3203168211198807973,
                                   9817491932198370423, 4593380528125082431,
                                   16408922859458223821]
    # and from seed 0, the stream's first output
    assert int(mix(np.array([G], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF


def test_uniforms_equal_the_pure_python_reference_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    seeds = [0, 1, 2**63, 2**64 - 1, *rng.integers(0, 2**63, size=4).tolist()]
    positions = [0, 1, 7, 4095, 0, 3, 100_000, 2**31]
    vocab = 101  # odd: the last pair's high half is unused
    keys = row_keys(np.array(seeds, dtype=np.uint64), np.array(positions))  # (8,)
    dense = uniforms_dense(keys, vocab)  # (8, V)
    assert dense.shape == (8, vocab) and dense.dtype == np.float32
    token_ids = rng.integers(0, vocab, size=(8, 13))  # (8, 13)
    sparse = uniforms(keys, token_ids)
    for r, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        want = np.array([ref_uniform(seed, position, t) for t in range(vocab)])
        assert np.array_equal(dense[r].astype(np.float64), want)  # exact: 24-bit values
        assert np.array_equal(sparse[r], dense[r, token_ids[r]])


def test_uniforms_are_inside_the_open_interval_and_gumbel_is_finite() -> None:
    edges = np.array([0, 1, 2**9 - 1, 2**32 - 1, 2**32 - 2**9], dtype=np.uint64)
    u = _halves_to_uniform(edges)
    assert u.min() == np.float32(2.0**-24) and u.max() == np.float32(1 - 2.0**-24)
    g = gumbel_(u.copy())
    assert np.isfinite(g).all() and g.max() < NOISE_MAX  # the pruned draw relies on the bound
    want = [-math.log(-math.log(float(x))) for x in u]
    np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)


def test_gumbel_matches_float64_math() -> None:
    keys = row_keys(np.array([5, 6], dtype=np.uint64), np.array([0, 9]))
    u = uniforms_dense(keys, 4000)  # (2, 4000)
    want = -np.log(-np.log(u.astype(np.float64)))
    np.testing.assert_allclose(gumbel_(u.copy()), want, rtol=2e-6, atol=2e-6)


def test_the_noise_depends_on_seed_position_and_token_only() -> None:
    keys = row_keys(np.array([7, 7, 8, 7], dtype=np.uint64), np.array([3, 4, 3, 3]))
    u = uniforms_dense(keys, 64)  # (4, 64)
    assert np.array_equal(u[0], u[3])  # same (seed, position): same numbers
    assert not np.array_equal(u[0], u[1]) and not np.array_equal(u[0], u[2])
    alone = uniforms_dense(keys[1:2], 64)
    assert np.array_equal(alone[0], u[1])  # whatever else is in the batch


def test_uniforms_are_uniform_and_uncorrelated() -> None:
    """Chi-square over 64 bins of 2**20 draws (seeds x positions x tokens), and no linear
    correlation between neighbours in any of the three counters."""
    seeds = np.repeat(np.arange(16, dtype=np.uint64), 16)  # (256,)
    positions = np.tile(np.arange(16), 16)
    u = uniforms_dense(row_keys(seeds, positions), 4096).astype(np.float64)  # (256, 4096)
    counts = np.bincount((u * 64).astype(np.int64).ravel(), minlength=64)
    expected = u.size / 64
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < 63 + 6 * math.sqrt(2 * 63), stat
    assert abs(u.mean() - 0.5) < 1e-3
    grid = u.reshape(16, 16, 4096)  # (seed, position, token)
    for a, b in [(grid[:, :, :-1], grid[:, :, 1:]), (grid[:, :-1], grid[:, 1:]),
                 (grid[:-1], grid[1:])]:
        corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(corr) < 0.01, corr


def test_make_seed() -> None:
    seq = np.random.SeedSequence(7)
    assert make_seed(42, seq) == 42
    assert make_seed(-1, seq) == 2**64 - 1 == make_seed(2**64 - 1, seq)
    a = [make_seed(None, np.random.SeedSequence(7)) for _ in range(2)]
    b = [make_seed(None, seq), make_seed(None, seq)]
    assert a[0] == a[1] == b[0] != b[1]  # fresh spawns differ; same engine seed reproduces
    assert all(0 <= s < 2**64 for s in b)



def test_the_portable_halves_equal_the_little_endian_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """uniforms_dense splits each uint64 into (low, high) by a uint32 view on little-endian NumPy
    and by shifts elsewhere (CuPy, big-endian): the same numbers."""
    keys = row_keys(np.arange(3, dtype=np.uint64), np.array([0, 5, 9]))
    view = uniforms_dense(keys, 77)
    monkeypatch.setattr(rng.sys, "byteorder", "big")
    assert np.array_equal(uniforms_dense(keys, 77), view)

"""The counter-based random generator of the xp sampler: (seed, position, token id) -> Gumbel noise.

Every random number is a pure function of the request's seed, the output position being sampled
and the vocabulary index, computed with elementwise uint64/uint32 ops that NumPy and CuPy both
have. So a row draws the same bits on the CPU and on the GPU, whatever else is in the batch and in
whatever order, and a preempted sequence that recomputes draws again what it drew before.

The hash is SplitMix64 (Steele, Lea & Flood 2014; Vigna's constants): the row key is
    key = mix(mix(seed + G) + (position + 1) * G)
and the 64 bits for the token pair j = token_id >> 1 are the j-th output of the SplitMix64 stream
that starts at `key`,
    bits = mix(key + (j + 1) * G),
whose low 32 bits serve the even token 2j and whose high 32 bits serve the odd token 2j + 1 (one
hash per two tokens). A 32-bit half h becomes u = (2 * (h >> 9) + 1) * 2**-24: the top 23 bits,
centred, exact in float32 and strictly inside (0, 1), so -log(-log(u)) is finite.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvcore.device import array_module

GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd: SplitMix64's stream increment
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
# bits of each 32-bit half that make a uniform (2k + 1 < 2**24: exact); the extreme uniforms
# 2**-24 and 1 - 2**-24 bound the Gumbel noise to [-2.81, 16.64] (xp_sampler prunes with it)
UNIFORM_BITS = 23
_U64 = np.uint64  # explicit uint64 operands: a Python int above 2**63 is no int64 for CuPy


def make_seed(seed: int | None, seed_sequence: np.random.SeedSequence) -> int:
    """A sequence's seed as an int in [0, 2**64): the request's own seed (negative seeds map to
    seed mod 2**64), or for an unseeded request 64 bits drawn once from a
    spawn of the engine's SeedSequence. Create it once per sequence (n > 1: seed + index)."""
    if seed is None:
        return int(seed_sequence.spawn(1)[0].generate_state(1, np.uint64)[0])
    return seed % 2**64


def mix(x: Any) -> Any:
    """SplitMix64's finalizer over a uint64 array (NumPy or CuPy); wraps modulo 2**64."""
    return mix_(x.copy())


def mix_(x: Any) -> Any:
    """mix() in place (fewer temporaries: on the CPU each one costs a pass of page faults)."""
    x ^= x >> _U64(30)
    x *= _U64(MIX_1)
    x ^= x >> _U64(27)
    x *= _U64(MIX_2)
    x ^= x >> _U64(31)
    return x


def row_keys(seeds: Any, positions: Any) -> Any:
    """(R,) uint64 keys from (R,) seeds (uint64) and (R,) output positions (int64 >= 0)."""
    xp = array_module(seeds)
    seeds = xp.asarray(seeds, dtype=xp.uint64)
    steps = (xp.asarray(positions).astype(xp.uint64) + _U64(1)) * _U64(GOLDEN)
    return mix_(mix_(seeds + _U64(GOLDEN)) + steps)  # (R,)


def _halves_to_uniform(halves: Any) -> Any:
    """uint32 (or uint64 < 2**32) halves -> float32 uniforms (2 * (h >> 9) + 1) * 2**-24."""
    xp = array_module(halves)
    odd = halves >> halves.dtype.type(32 - UNIFORM_BITS)
    odd <<= halves.dtype.type(1)
    odd |= halves.dtype.type(1)
    u = odd.astype(xp.float32)
    u *= xp.float32(2.0**-24)
    return u


def uniforms(keys: Any, token_ids: Any) -> Any:
    """Uniforms in (0, 1) for the tokens `token_ids` (R, N) int64 of rows with `keys` (R,):
    (R, N) float32, equal bit for bit to the same columns of uniforms_dense."""
    xp = array_module(token_ids)
    ids = token_ids.astype(xp.uint64)
    bits = ids >> _U64(1)  # (R, N) the token pair
    bits += _U64(1)
    bits *= _U64(GOLDEN)
    bits += keys[:, None]
    mix_(bits)
    ids &= _U64(1)
    ids <<= _U64(5)  # 0 for an even token (low half), 32 for an odd one (high half)
    bits >>= ids
    bits &= _U64(0xFFFFFFFF)
    return _halves_to_uniform(bits)


def uniforms_dense(keys: Any, vocab_size: int) -> Any:
    """Uniforms for every token id 0..vocab_size-1 of rows with `keys` (R,): (R, V) float32."""
    xp = array_module(keys)
    num_pairs = (vocab_size + 1) // 2
    counters = (xp.arange(num_pairs, dtype=xp.uint64) + _U64(1)) * _U64(GOLDEN)  # (J,)
    bits = mix_(keys[:, None] + counters[None, :])  # (R, J) uint64
    if xp is np and sys.byteorder == "little":
        # a little-endian uint64 viewed as two uint32 is (low, high): tokens (2j, 2j + 1)
        halves = bits.view(np.uint32)  # (R, 2J)
    else:
        halves = xp.stack([bits & _U64(0xFFFFFFFF), bits >> _U64(32)], axis=2).reshape(
            len(keys), 2 * num_pairs)
    return _halves_to_uniform(halves)[:, :vocab_size]


def gumbel_(u: Any) -> Any:
    """Turn uniforms into Gumbel(0, 1) noise -log(-log(u)) in place (float32); returns `u`."""
    xp = array_module(u)
    xp.log(u, out=u)
    xp.negative(u, out=u)
    xp.log(u, out=u)
    xp.negative(u, out=u)
    return u

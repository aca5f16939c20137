"""Sampling: parameters, batched logits processors, the xp sampler (NumPy and CuPy),
stop conditions, beam scoring."""

from kvcore.sampling.beam import (
    BeamCandidate,
    BeamHypotheses,
    BeamHypothesis,
    BeamSearch,
    BeamStep,
    length_penalized,
    top_candidates,
)
from kvcore.sampling.params import BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.sampling.rng import make_seed
from kvcore.sampling.row_sampler import RowSampler
from kvcore.sampling.rows import SamplerOutput, SamplingRow
from kvcore.sampling.stop import find_stop_string, num_holdback_chars
from kvcore.sampling.xp_batch import SamplingBatch
from kvcore.sampling.xp_sampler import DeviceSample, XpSampler

__all__ = [
    "BeamCandidate",
    "BeamHypotheses",
    "BeamHypothesis",
    "BeamSearch",
    "BeamSearchParams",
    "BeamStep",
    "DeviceSample",
    "RowSampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "XpSampler",
    "find_stop_string",
    "length_penalized",
    "make_seed",
    "num_holdback_chars",
    "top_candidates",
]

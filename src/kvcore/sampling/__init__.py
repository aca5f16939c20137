"""Sampling: parameters, batched logits processors, the samplers (NumPy; xp for NumPy and CuPy),
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
from kvcore.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    draw,
    make_generator,
    process_logits,
)
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
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "XpSampler",
    "draw",
    "find_stop_string",
    "length_penalized",
    "make_generator",
    "make_seed",
    "num_holdback_chars",
    "process_logits",
    "top_candidates",
]

"""Sampling: parameters, batched logits processors, the sampler, stop conditions, beam scoring."""

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
from kvcore.sampling.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    draw,
    make_generator,
    process_logits,
)
from kvcore.sampling.stop import find_stop_string, num_holdback_chars

__all__ = [
    "BeamCandidate",
    "BeamHypotheses",
    "BeamHypothesis",
    "BeamSearch",
    "BeamSearchParams",
    "BeamStep",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingRow",
    "TokenLogprob",
    "draw",
    "find_stop_string",
    "length_penalized",
    "make_generator",
    "num_holdback_chars",
    "process_logits",
    "top_candidates",
]

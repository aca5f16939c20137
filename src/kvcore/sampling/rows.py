"""One row of a sampling batch (a sequence that samples this step) and the sampler's output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcore.sampling.params import SamplingParams, TokenLogprob


@dataclass(slots=True)  # not frozen: one is made per row per step, and frozen inits cost more
class SamplingRow:
    """One row of the logits batch: a sequence that samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (before this step's)
    seed: int | None = None  # the per-sequence seed (rng.make_seed); required unless greedy
    # the output position (tokens generated so far) when output_token_ids is left
    # empty because no processor reads the history; None: len(output_token_ids)
    position: int | None = None
    # a constrained row's packed token bitmask, (ceil(V / 32),) int32 (constraints.MaskFiller)
    token_mask: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: np.ndarray  # (B,) int64, the sampled token of each row
    logprobs: list[TokenLogprob | None]  # per row; None where params.logprobs is None

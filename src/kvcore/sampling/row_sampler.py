"""RowSampler: the engine core's sampler, the xp sampler run on the logits' own device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kvcore.device import array_module, to_numpy
from kvcore.sampling.params import SamplingParams
from kvcore.sampling.rows import SamplerOutput, SamplingRow
from kvcore.sampling.xp_sampler import XpSampler


class RowSampler:
    """(logits, SamplingRows) -> SamplerOutput on the logits' device (NumPy or CuPy: one
    XpSampler per array module, made on first use)."""

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self._samplers: dict[ModuleType, XpSampler] = {}

    def for_module(self, xp: ModuleType) -> XpSampler:
        sampler = self._samplers.get(xp)
        if sampler is None:
            sampler = self._samplers[xp] = XpSampler(self.eos_token_ids, self.vocab_size, xp)
        return sampler

    def __call__(self, logits: Any, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` (B, V), one row per entry of `rows`; float32 logits are modified in place."""
        _, read = self.launch(logits, rows)
        return read()

    def launch(self, logits: Any, rows: Sequence[SamplingRow]
               ) -> tuple[Any, Callable[[], SamplerOutput]]:
        """The draw in two halves (async scheduling): queued on the logits' device now,
        returning its (B,) device token ids, and the read-back, to call when the host needs
        the tokens (only then does it wait for the device)."""
        if all(_plain_greedy(r.params) for r in rows):  # one argmax: no batch to build
            if logits.ndim != 2 or logits.shape != (len(rows), self.vocab_size):
                raise ValueError(f"logits must be (B={len(rows)}, V={self.vocab_size}), got "
                                 f"{logits.shape}")
            xp = array_module(logits)
            ids = logits.argmax(axis=1).astype(xp.int64, copy=False)  # (B,) on the device
            return ids, lambda: SamplerOutput(
                token_ids=to_numpy(ids).astype(np.int64, copy=False),
                logprobs=[None] * len(rows))
        sampler = self.for_module(array_module(logits))
        batch = sampler.batch(rows)
        sample = sampler.sample(logits, batch)
        return sample.token_ids, lambda: sampler.to_host(sample, batch)


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy, no processor, no logprobs: SamplingBatch.plain_greedy, decided without a batch."""
    return p.argmax_only and p.logprobs is None

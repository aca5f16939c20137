"""The engine core's seam to structured outputs: the token masks of a step's constrained rows
(computed while the forward pass runs), and a beam's tokens through its matcher."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.device import array_module
from kvcore.engine.records import Launched
from kvcore.kernels.token_mask import apply_token_bitmask
from kvcore.request import Sequence
from kvcore.sampling import SamplingRow
from kvcore.sampling.masks import MaskFiller


@dataclasses.dataclass(frozen=True, slots=True)
class StepMasks:
    """The masks of one step's constrained rows: started at launch in the mask worker, taken
    by the draw after the forward pass. Rows without a constraint pay nothing."""

    rows: list[int]  # positions of the constrained rows in the step's row list
    future: Future[np.ndarray]  # (C, W) int32 bitmasks
    owner: Constrainer

    def apply(self, sampling_rows: list[SamplingRow]) -> list[SamplingRow]:
        start = time.perf_counter()
        masks = self.future.result()
        self.owner.wait_seconds += time.perf_counter() - start
        out = list(sampling_rows)
        for k, i in enumerate(self.rows):
            out[i] = dataclasses.replace(out[i], token_mask=masks[k])
        return out


class Constrainer:
    """Owns the mask worker (made on the first constrained step)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._filler: MaskFiller | None = None
        # the draws' total wait for masks not ready yet (on a GPU: the device idling on the
        # host), for benchmarks
        self.wait_seconds = 0.0

    @property
    def filler(self) -> MaskFiller:
        if self._filler is None:
            self._filler = MaskFiller(self.vocab_size)
        return self._filler

    def mask_times(self) -> tuple[tuple[float, ...], tuple[int, ...], float] | None:
        """The histogram of mask seconds per step (None before the first constrained step)."""
        return None if self._filler is None else self._filler.times.snapshot()

    def start(self, seqs: list[Sequence], prev: Launched | None = None) -> StepMasks | None:
        """Start computing the masks of `seqs`' constrained rows (None: no row has one). A row
        whose last token is pending (async scheduling) first consumes it, read from the step
        before (`prev`) in the mask worker, while this step's forward pass runs."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        matchers = [seqs[i].matcher for i in rows]
        pending = [(m, seqs[i].num_output_tokens - 1, seqs[i].seq_id)
                   for i, m in zip(rows, matchers, strict=True)
                   if m is not None and seqs[i].token_ids[-1] == PENDING_TOKEN_ID]
        fill = self.filler.fill

        def job() -> np.ndarray:
            if pending:
                assert prev is not None
                token_ids = prev.host_ids()  # waits for the step before's draw
                for matcher, position, seq_id in pending:
                    # refused: that row's draw failed (its request fails); appending
                    # re-checks the token
                    with contextlib.suppress(ValueError):
                        matcher.consume_at(position, token_ids[prev.row_of[seq_id]])
            return fill(matchers)  # type: ignore[arg-type]
        return StepMasks(rows, self.filler.submit(job), self)

    def masked_rows(self, seqs: list[Sequence], rows: list[SamplingRow]) -> list[SamplingRow]:
        """`rows` with their masks, computed now (host-side draws: a fork's first token)."""
        masks = self.start(seqs)
        return rows if masks is None else masks.apply(rows)

    def mask_logits(self, seqs: list[Sequence], logits: Any, rows: list[int]) -> None:
        """Mask logits row rows[i] for seqs[i] in place, where it has a constraint (beams:
        before the policy ranks them)."""
        masks = self.start(seqs)
        if masks is None:
            return
        xp = array_module(logits)
        index = np.array([rows[i] for i in masks.rows], dtype=np.int64)  # (C,)
        apply_token_bitmask(logits, xp.asarray(index), xp.asarray(masks.future.result()))


def append_beam_token(seq: Sequence, token_id: int) -> None:
    """A beam's next token (the policy decides when beams end, not the stop checks)."""
    seq.token_ids.append(token_id)
    if seq.matcher is not None:
        seq.matcher.consume_at(seq.num_output_tokens - 1, token_id)


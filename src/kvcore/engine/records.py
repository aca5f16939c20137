"""The engine core's records: what a step gives out (for the output processor), and the core's
own bookkeeping of a launched step."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine.draw import HostDraw
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import BeamHypothesis, TokenLogprob
from kvcore.scheduler import SchedulerOutput

# one token a sequence got in a step: (its sequence, the token, its logprob when asked for, the
# status that ended the sequence with it or None); the output processor reads the request's
# values (id, choice index, cached tokens...) from the sequence itself, never copied per token
Emitted = tuple[Sequence, int, TokenLogprob | None, SequenceStatus | None]


@dataclass(slots=True)
class StepOutput:
    tokens: list[Emitted] = field(default_factory=list)
    beams: dict[str, list[BeamHypothesis]] = field(default_factory=dict)  # done: best first
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why it failed


@dataclass(slots=True)
class Drawn:
    """What a launched step's device work returns (device arrays where the device has them)."""

    token_ids: Any  # (P,) int64 the plain rows' tokens on the device, row order (failed: 0)
    read: Callable[[], HostDraw]  # the host's copy of the tokens (and the asked logprobs)
    failed: dict[int, BaseException]  # plain row -> why its draw failed (its request fails)
    host_logits: Any  # (H, V) logits of the host rows (beams), a copy; None if none


@dataclass(slots=True)
class Launched:
    """A step on the device: its schedule, its sampling rows, the future of its Drawn."""

    out: SchedulerOutput
    plain: list[Sequence]  # rows drawn on the device, in row order (k drafts: k + 1 rows)
    host: list[Sequence]  # rows the host decides after the step (beams)
    # some row needs the host between this step and the next (a beam, drafts, a
    # sampler that reads the history): collect this step before scheduling the next
    needs_host: bool
    drafts: dict[str, list[int]]  # the draft tokens each speculating sequence verifies
    future: Future[Drawn]
    row_of: dict[str, int] = field(init=False)  # a sequence's (last) row among `plain`

    def __post_init__(self) -> None:
        self.row_of = {seq.seq_id: i for i, seq in enumerate(self.plain)}

    def device_ids(self) -> Any:
        """(P,) its sampled token ids on their device (waits for its draw)."""
        return self.future.result().token_ids

    def host_ids(self) -> list[int]:
        """Its sampled token ids on the host (waits for the device)."""
        return self.future.result().read()[0]

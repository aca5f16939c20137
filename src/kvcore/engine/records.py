"""The engine core's records: what a step gives out (plain data for the output processor), and
the core's own bookkeeping of a launched step and of a request's live sequences."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine.beam import BeamPolicy
from kvcore.engine.draw import HostDraw
from kvcore.request import Sequence
from kvcore.sampling import BeamHypothesis, TokenLogprob
from kvcore.scheduler import SchedulerOutput


@dataclass(slots=True)
class SeqOutput:
    """What one sequence got in one step."""

    seq_id: str
    request_id: str
    index: int  # choice index within its request
    token_ids: list[int]  # new this step
    logprobs: list[TokenLogprob] | None  # of those tokens, when the request asked for them
    finish_reason: str | None  # set when the core ended the sequence (stop id, length)
    stop_reason: int | None
    num_cached_tokens: int  # prompt tokens its first admission found in the prefix cache
    first_scheduled_time: float | None
    num_draft_tokens: int = 0  # speculative draft tokens the sequence verified so far
    num_accepted_tokens: int = 0  # of those, accepted


@dataclass(slots=True)
class StepOutput:
    seqs: list[SeqOutput] = field(default_factory=list)
    beams: dict[str, list[BeamHypothesis]] = field(default_factory=dict)  # done: best first
    failed: dict[str, str] = field(default_factory=dict)  # request_id -> why it failed


@dataclass(slots=True)
class Drawn:
    """What a launched step's device work returns (device arrays where the device has them)."""

    token_ids: Any  # (P,) int64 the plain rows' tokens on the device, row order (failed: 0)
    read: Callable[[], HostDraw]  # the host's copy of the tokens (and the asked logprobs)
    failed: dict[int, BaseException]  # plain row -> why its draw failed (its request fails)
    host_logits: Any  # (H, V) logits of the host rows (forks, beams), a copy; None if none


@dataclass(slots=True)
class Launched:
    """A step on the device: its schedule, its sampling rows, the future of its Drawn."""

    out: SchedulerOutput
    plain: list[Sequence]  # rows drawn on the device, in row order (k drafts: k + 1 rows)
    host: list[Sequence]  # rows the host decides after the step: a fork's first, beams
    # some row needs the host between this step and the next (a fork, a beam, drafts, a
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


@dataclass(slots=True)
class Group:
    """The live sequences of one user request, as the core knows them."""

    request_id: str
    seqs: list[Sequence]  # unfinished; beams in the policy's order
    policy: BeamPolicy | None
    num_forks: int = 0

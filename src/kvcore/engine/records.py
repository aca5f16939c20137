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


class Launched:
    """A step on the device: its schedule, its sampling rows, the future of its _Drawn."""

    __slots__ = ("out", "plain", "host", "future", "needs_host", "row_of", "drafts")

    def __init__(self, out: SchedulerOutput, plain: list[Sequence], host: list[Sequence],
                 needs_host: bool, drafts: dict[str, list[int]] | None = None) -> None:
        self.out = out
        # rows drawn on the device, in row order (a sequence verifying k drafts: k + 1 rows)
        self.plain = plain
        self.host = host  # rows the host decides after the step: a fork's first, beams
        # some row needs the host between this step and the next (a fork, a beam, a sampler
        # that reads the history): collect this step before scheduling the next
        self.needs_host = needs_host
        self.row_of = {seq.seq_id: i for i, seq in enumerate(plain)}
        self.future: Future[Drawn] | None = None
        self.drafts = drafts or {}  # the draft tokens each speculating sequence verifies


class Group:
    """The live sequences of one user request, as the core knows them."""

    __slots__ = ("request_id", "seqs", "policy", "num_forks")

    def __init__(self, first: Sequence, policy: BeamPolicy | None) -> None:
        self.request_id = first.request_id
        self.seqs: list[Sequence] = [first]  # unfinished; beams in the policy's order
        self.policy = policy
        self.num_forks = 0

"""A sequence as the scheduler and the engine core see it, and the user-facing outputs."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvcore.sampling.constraints import SeqMatcher
from kvcore.sampling.params import BeamSearchParams, SamplingParams, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds blocks; scheduled every step it has tokens to compute
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller (or the client went away)
    FINISHED_ERROR = "error"  # failed inside the engine (its sampling, output processing...)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


_FINISHED = {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
             SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR}


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() stamps of a request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified (all choices)
    num_accepted_tokens: int = 0  # of those, accepted
    restored_tokens: dict[str, int] | None = None  # prompt tokens loaded from each KV tier

    @property
    def acceptance(self) -> float | None:
        """Accepted / verified draft tokens; None when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(slots=True)
class CompletionOutput:
    """One choice of a request: what is new since the request's previous output (a beam search
    reports once, each beam whole). merge_outputs accumulates a request's outputs."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # when asked for
    cumulative_logprob: float | None  # of every token so far (logprobs asked, or beams)
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # the request's own list (not a copy): do not modify
    outputs: list[CompletionOutput]  # the choices that changed (the beams, best first, at the end)
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    error: str | None = None  # set (and finished) when the engine failed this request


def merge_outputs(outputs: Iterable[RequestOutput]) -> RequestOutput:
    """One request's outputs in order -> one output holding every choice whole (by index)."""
    parts: dict[int, tuple[list[str], list[int], list[TokenLogprob] | None]] = {}
    last: dict[int, CompletionOutput] = {}
    out: RequestOutput | None = None
    for out in outputs:
        for c in out.outputs:
            text, token_ids, logprobs = parts.setdefault(
                c.index, ([], [], None if c.logprobs is None else []))
            text.append(c.text)
            token_ids.extend(c.token_ids)
            if logprobs is not None and c.logprobs is not None:
                logprobs.extend(c.logprobs)
            last[c.index] = c
    assert out is not None, "no outputs to merge"
    choices = [CompletionOutput(i, "".join(parts[i][0]), parts[i][1], parts[i][2],
                                last[i].cumulative_logprob, last[i].finish_reason,
                                last[i].stop_reason) for i in sorted(parts)]
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, choices, out.finished,
                         out.num_cached_tokens, out.metrics, out.error)


@dataclass(eq=False, slots=True)
class Sequence:
    """One sequence of tokens and how many of them have K/V in the cache.

    The scheduler knows no prefill or decode phase: each step it gives a sequence up to
    `num_tokens - num_computed_tokens` tokens of the budget. `seq_id` is also its id in the
    KVCacheManager. The n choices of one user request (and the beams of a beam search) are
    separate sequences with the same `request_id`; forks share their parent's blocks.
    Token-level stop conditions (stop token ids, length) are checked here; stop strings are the
    output processor's (it aborts the sequence when one appears).
    """

    seq_id: str
    request_id: str  # the user request it belongs to
    prompt_token_ids: list[int]  # shared by every sequence of the request; never modified
    params: SamplingParams | BeamSearchParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    index: int = 0  # choice index (n > 1) or beam number within its request
    priority: int = 0  # lower runs first (as vLLM)
    cache_salt: str | None = None
    prompt: str | None = None  # the prompt's text, when it came as text (the outputs carry it)
    arrival_time: float = field(default_factory=time.monotonic)
    stop_token_ids: frozenset[int] = frozenset()  # end it (after min_tokens): EOS, stop ids
    eos_token_ids: frozenset[int] = frozenset()  # of those, EOS (reported as stop_reason None)
    # the random draws' seed (sampling.rng.make_seed, set once by the engine core): a draw
    # depends only on (seed, output position, token id), never on what else is in the batch
    seed: int | None = None
    # sequences this one will still fork (n - 1 before an n > 1 request's first token;
    # beam_width - 1 before a beam search's first step): counted toward max_num_seqs
    num_pending_forks: int = 0
    # its tokens are chosen on the host from its logits rows (a beam search's policy), not drawn
    host_decides: bool = False
    # structured output: where its tokens stand in the request's constraint (None: none)
    matcher: SeqMatcher | None = None
    # mutable state
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_seq: int = 0  # admission order tie-break, set by the scheduler
    last_scheduled_step: int = -1  # fairness: least recently served goes first
    first_scheduled_time: float | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0  # speculative draft tokens verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    num_prompt_tokens: int = field(init=False)
    length_limit: int = field(init=False)  # total tokens at which it ends ("length")
    min_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, self.seq_id  # checked where the request entered
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        self.min_tokens = self.params.min_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_seqs(self) -> int:
        """Sequences this one runs at once when admitted: itself and its pending forks."""
        return 1 + self.num_pending_forks

    @property
    def finished(self) -> bool:
        status = self.status  # (identity tests: an enum member's hash runs Python code)
        return status is not SequenceStatus.RUNNING and status is not SequenceStatus.WAITING

    def append_token(self, token_id: int) -> SequenceStatus | None:
        """Append a generated token; returns the finished status (stop_reason set) when a stop
        token id (after min_tokens) or the length limit ends the sequence, else None."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        if token_id in self.stop_token_ids and len(token_ids) - self.num_prompt_tokens >= (
                self.min_tokens):
            if token_id not in self.eos_token_ids:
                self.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if self.matcher is not None:
            try:
                # complete: nothing but its end may follow
                if self.matcher.consume_at(len(token_ids) - 1 - self.num_prompt_tokens, token_id):
                    return SequenceStatus.FINISHED_STOPPED
            except ValueError:  # a token the mask allowed and the matcher refused
                return SequenceStatus.FINISHED_ERROR
        if len(token_ids) >= self.length_limit:
            return SequenceStatus.FINISHED_LENGTH
        return None

"""Request state (tokens, `num_computed_tokens` catching up with them) and engine outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcore.sampling.params import BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.sampling.stop import StopChecker

if TYPE_CHECKING:
    import numpy as np

    from kvcore.model.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds blocks; scheduled every step it has tokens to compute
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # aborted by the caller (or the client went away)
    FINISHED_ERROR = "error"  # failed inside the engine (its sampling, stop checks, forward...)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self in _FINISHED else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() stamps of a request's life; None until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    delta_text: str  # new since the previous output of this request
    delta_token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # cumulative, when asked for
    delta_logprobs: list[TokenLogprob] | None
    cumulative_logprob: float | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None  # the stop token id or stop string that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n choices (or the beams, best first, when finished)
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics
    error: str | None = None  # set (and finished) when the engine failed this request


@dataclass(eq=False, slots=True)
class Request:
    """One sequence the scheduler runs: its tokens and how many of them have K/V in the cache.

    The scheduler knows no prefill or decode phase: each step it gives a request up to
    `num_tokens - num_computed_tokens` tokens of the budget. `request_id` is also the sequence id
    in the KVCacheManager. The n choices of one user request (and the beams of a beam search) are
    separate Requests that share `group_id` and fork each other's blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    prompt: str | None = None
    priority: int = 0  # lower runs first (as vLLM)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    group_id: str | None = None  # the user request this sequence belongs to (None: itself)
    index: int = 0  # choice index within its group
    # sequences this request will still fork (n - 1 before an n > 1 request's first token;
    # beam_width - 1 before a beam search's first step): counted toward max_num_seqs
    num_pending_forks: int = 0
    generator: np.random.Generator | None = None  # per-request RNG for seeded sampling
    detokenizer: IncrementalDetokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mutable state
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + outputs, kept in step
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    arrival_seq: int = 0  # admission order tie-break, set by the scheduler
    last_scheduled_step: int = -1  # fairness: least recently served goes first
    text: str = ""  # detokenized output, including a held-back possible stop-string prefix
    num_text_visible: int = 0  # chars of `text` that may be streamed (the rest may be a stop)
    num_text_emitted: int = 0  # chars of `text` already handed out
    num_tokens_emitted: int = 0
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(init=False)
    stop_checker: StopChecker | None = field(init=False)  # None for beams (the group decides)
    # what can end the request, so most tokens skip the full check: stop ids (EOS included unless
    # ignored), whether there are stop strings, and the total length that ends it
    _stop_ids: frozenset[int] = field(init=False)
    _stop_strings: bool = field(init=False)
    _length_limit: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"prompt of request {self.request_id!r} must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + self.output_token_ids
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # the resolved max_tokens becomes a total-length limit, so one check covers both
        # params.max_tokens and max_model_len
        self.stop_checker = None
        self._stop_ids = frozenset()
        self._stop_strings = False
        self._length_limit = self.num_prompt_tokens + self.max_tokens
        if isinstance(self.params, SamplingParams):
            checker = StopChecker(self.params, self.eos_token_ids, self._length_limit)
            self.stop_checker = checker
            self._stop_ids = checker.eos_token_ids | checker.stop_token_ids
            self._stop_strings = bool(self.params.stop)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_seqs(self) -> int:
        """Sequences this request runs at once when admitted: itself and its pending forks."""
        return 1 + self.num_pending_forks

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Append a generated token, detokenize it and check the stop conditions; returns the
        finished status (stop_reason set) or None while the request goes on."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_new_chars = 0
        if self.detokenizer is not None:
            piece = self.detokenizer.add(token_id)
            self.text += piece
            num_new_chars = len(piece)
        checker = self.stop_checker
        if checker is None:
            self.num_text_visible = len(self.text)
            return None
        if (not self._stop_strings and token_id not in self._stop_ids
                and len(self.all_token_ids) < self._length_limit):
            self.num_text_visible = len(self.text)  # nothing can end it with this token
            return None
        result = checker.check(token_id, len(self.output_token_ids), len(self.all_token_ids),
                               self.text, num_new_chars)
        if result is None:
            held = checker.holdback(self.text) if checker.params.stop else 0
            self.num_text_visible = len(self.text) - held
            return None
        self.text = result.text
        if self.detokenizer is not None and not isinstance(result.stop_reason, str):
            self.text += self.detokenizer.flush()  # an incomplete character left at the end
        self.num_text_visible = len(self.text)
        self.stop_reason = result.stop_reason
        if result.finish_reason == "stop":
            return RequestStatus.FINISHED_STOPPED
        return RequestStatus.FINISHED_LENGTH

    def completion(self) -> CompletionOutput:
        """This sequence's output so far, with the delta since the previous call. Text held back
        as a possible stop-string prefix goes out once it cannot be one (or at the end)."""
        text = self.text if self.finished else self.text[:self.num_text_visible]
        start_text, start_tok = self.num_text_emitted, self.num_tokens_emitted
        self.num_text_emitted = max(len(text), start_text)
        self.num_tokens_emitted = len(self.output_token_ids)
        logprobs = self.logprobs
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.output_token_ids),
            delta_text=text[start_text:],
            delta_token_ids=self.output_token_ids[start_tok:],
            logprobs=None if logprobs is None else list(logprobs),
            delta_logprobs=None if logprobs is None else logprobs[start_tok:],
            cumulative_logprob=self.cumulative_logprob if logprobs is not None else None,
            finish_reason=self.status.finish_reason,
            stop_reason=self.stop_reason,
        )

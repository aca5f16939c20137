"""The output processor: user requests over the core's per-sequence tokens.

It owns what the core does not: the n choices of a request, beam results, incremental
detokenization, stop strings (a completed one ends the choice here and its sequence in the
core), and the outputs each consumer gets. An output carries what changed since the request's
previous one (its final output too); the processor keeps no choice's whole text or tokens, only
what is not streamed yet and the window where a stop string may still complete.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import structlog

from kvcore.engine.records import StepOutput
from kvcore.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvcore.request import CompletionOutput, RequestMetrics, RequestOutput, Sequence, SequenceStatus
from kvcore.sampling import BeamHypothesis, BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.sampling.stop import find_stop_string, num_holdback_chars

log = structlog.get_logger(__name__)


class _Choice:
    """One choice: what it produced since its last delta, and its stop-string window."""

    __slots__ = ("index", "params", "detokenizer", "token_ids", "logprobs", "pending", "tail",
                 "num_tokens", "cumulative_logprob", "finish_reason", "stop_reason",
                 "stop_window")

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.index = index
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_ids: list[int] = []  # new since the last delta
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.pending = ""  # text not streamed yet (held back: it may become a stop string)
        self.tail = ""  # the last chars of the text, where a stop string may still complete
        self.num_tokens = 0
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_window = max((len(s) for s in params.stop), default=0)

    def add(self, token_id: int, logprob: TokenLogprob | None, status: SequenceStatus | None,
            stop_reason: int | None) -> bool:
        """Take one new token (`status`: the core ended the sequence with it); True when a
        stop string ended the choice here."""
        self.num_tokens += 1
        self.token_ids.append(token_id)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
        piece = self.detokenizer.add(token_id)
        if self.stop_window:
            params = self.params
            window = self.tail + piece
            self.tail = window[-self.stop_window:]
            if self.num_tokens >= params.min_tokens and status in (
                    None, SequenceStatus.FINISHED_LENGTH):  # a stop id ends it first
                found = find_stop_string(window, len(piece), params.stop,
                                         params.include_stop_str_in_output)
                if found is not None:
                    # what follows the kept text was never streamed (it was held back)
                    pending = self.pending + piece
                    self.pending = pending[:max(0, len(pending) - len(window) + len(found[1]))]
                    self.finish_reason, self.stop_reason = "stop", found[0]
                    return True
        self.pending += piece
        if status is not None:
            self.pending += self.detokenizer.flush()  # an incomplete character left at the end
            self.finish_reason, self.stop_reason = status.finish_reason, stop_reason
        return False

    def delta(self, finished: bool) -> CompletionOutput:
        """What is new since the last delta (all of it once the choice or its request ends)."""
        pending = self.pending
        held = (num_holdback_chars(pending, self.params.stop,
                                   self.params.include_stop_str_in_output)
                if self.params.stop and not finished and self.finish_reason is None else 0)
        self.pending = pending[len(pending) - held:]
        token_ids, self.token_ids = self.token_ids, []
        logprobs = self.logprobs
        if logprobs is not None:
            self.logprobs = []
        return CompletionOutput(self.index, pending[:len(pending) - held], token_ids, logprobs,
                                self.cumulative_logprob if logprobs is not None else None,
                                self.finish_reason, self.stop_reason)


class _Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "choices", "metrics",
                 "num_cached_tokens", "error", "results", "num_unfinished")

    def __init__(self, seq: Sequence, tokenizer: Tokenizer) -> None:
        self.request_id = seq.request_id
        self.prompt = seq.prompt
        self.prompt_token_ids = seq.prompt_token_ids
        self.params = params = seq.params
        self.choices: list[_Choice] = (
            [_Choice(i, params, tokenizer) for i in range(params.n)]
            if isinstance(params, SamplingParams) else [])
        self.num_unfinished = len(self.choices)
        self.metrics = RequestMetrics(arrival_time=seq.arrival_time)
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.results: list[CompletionOutput] | None = None  # beams, once done

    def output(self, touched: Collection[_Choice], finish_reason: str | None = None
               ) -> RequestOutput:
        """The request's output: its touched choices' deltas; `finish_reason` (aborted,
        failed) ends every open choice, which the output then carries."""
        if finish_reason is not None:
            touched = [c for c in self.choices if c.finish_reason is None or c in touched]
            for choice in touched:
                choice.finish_reason = choice.finish_reason or finish_reason
        finished = (finish_reason is not None or self.results is not None
                    or (self.num_unfinished == 0 and bool(self.choices)))
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        outputs = (self.results if self.results is not None
                   else [c.delta(finished) for c in touched])
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             finished, self.num_cached_tokens, self.metrics, self.error)


class OutputProcessor:
    """Registered requests -> RequestOutputs, one per request that progressed in a step."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._requests: dict[str, _Request] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, seq: Sequence) -> None:
        """Register a request by its first sequence."""
        self._requests[seq.request_id] = _Request(seq, self.tokenizer)

    def discard(self, request_id: str) -> None:
        """Forget a request the core refused (nothing was ever produced for it)."""
        self._requests.pop(request_id, None)

    def abort(self, request_id: str, live_beams: list[list[int]] | None = None
              ) -> RequestOutput | None:
        """The final output of an aborted request (reason "abort"); None for an unknown id.
        A beam search reports its live beams (`live_beams`: their output token ids)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if isinstance(request.params, BeamSearchParams):
            decode = self.tokenizer.decode
            request.results = [CompletionOutput(i, decode(ids), ids, None, None, "abort", None)
                               for i, ids in enumerate(live_beams or [])]
        return request.output((), "abort")

    def process(self, step: StepOutput, stop_seq: Callable[[Sequence], None],
                fail_request: Callable[[str], object]) -> list[RequestOutput]:
        """One step's tokens -> outputs. `stop_seq(seq)` ends a sequence whose stop string
        appeared; `fail_request(request_id)` ends a request whose processing raised."""
        requests = self._requests
        touched: dict[str, tuple[_Request, dict[int, _Choice]]] = {}
        for seq, token_id, logprob, status in step.tokens:
            request = requests.get(seq.request_id)
            if request is None or request.error is not None:
                continue  # aborted meanwhile, or failed earlier in this step
            entry = touched.get(seq.request_id)
            if entry is None:
                entry = touched[seq.request_id] = (request, {})
                metrics = request.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = time.monotonic()
                    metrics.first_scheduled_time = seq.first_scheduled_time
                    request.num_cached_tokens = seq.num_cached_tokens
                if seq.num_draft_tokens:  # only n = 1 speculates: the request's own counts
                    metrics.num_draft_tokens = seq.num_draft_tokens
                    metrics.num_accepted_tokens = seq.num_accepted_tokens
            try:
                choice = request.choices[seq.index]
                if choice.finish_reason is not None:
                    continue  # ended by a stop string; the core computed one token more
                if choice.add(token_id, logprob, status, seq.stop_reason):  # type: ignore[arg-type]
                    stop_seq(seq)
                if choice.finish_reason is not None:
                    request.num_unfinished -= 1
                entry[1][seq.index] = choice
            except Exception as e:
                log.error("request failed", request_id=seq.request_id,
                          stage="output processing", error=f"{type(e).__name__}: {e}")
                request.error = f"output processing failed: {type(e).__name__}: {e}"
                fail_request(seq.request_id)
        for request_id, hyps in step.beams.items():
            request = requests.get(request_id)
            if request is not None:
                request.results = self._beam_results(request, hyps)
                touched[request_id] = (request, {})
        for request_id, error in step.failed.items():
            request = requests.get(request_id)
            if request is not None:
                request.error = error
                touched[request_id] = (request, {})
        outputs = []
        for request_id, (request, choices) in touched.items():
            if request.error is not None:
                outputs.append(request.output(choices.values(), "error"))
            else:
                outputs.append(request.output(choices.values()))
            if outputs[-1].finished:
                del requests[request_id]
        return outputs

    def _beam_results(self, request: _Request, hyps: list[BeamHypothesis]
                      ) -> list[CompletionOutput]:
        params = request.params
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        decode = self.tokenizer.decode
        return [CompletionOutput(
            i, decode(list(hyp.token_ids)), list(hyp.token_ids), None, hyp.cum_logprob,
            "stop" if hyp.token_ids[-1] in stop_ids else "length",
            hyp.token_ids[-1] if hyp.token_ids[-1] in params.stop_token_ids else None)
            for i, hyp in enumerate(hyps)]

"""The output processor: user requests over the core's per-sequence records.

It owns what the core does not: the n choices of a request, beam results, incremental
detokenization, stop strings (a completed one ends the choice here and its sequence in the
core), and the deltas each consumer gets. Text and token ids are kept once per choice; a step
produces deltas, and the cumulative fields are filled once, in the final output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import structlog

from kvcore.engine.records import SeqOutput, StepOutput
from kvcore.model.tokenizer import IncrementalDetokenizer, Tokenizer
from kvcore.request import CompletionOutput, RequestMetrics, RequestOutput
from kvcore.sampling import BeamHypothesis, BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.sampling.stop import find_stop_string, num_holdback_chars

log = structlog.get_logger(__name__)


class _Choice:
    """One choice's text and tokens: stored once, streamed as deltas."""

    __slots__ = ("index", "params", "detokenizer", "token_ids", "parts", "pending", "tail",
                 "num_emitted_tokens", "logprobs", "num_emitted_logprobs", "cumulative_logprob",
                 "finish_reason", "stop_reason", "stop_window")

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.index = index
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.parts: list[str] = []  # the text, piece by piece (joined once, at the end)
        self.pending = ""  # text not streamed yet (held back: it may become a stop string)
        self.tail = ""  # the last chars of the text, where a stop string may still complete
        self.num_emitted_tokens = 0
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.num_emitted_logprobs = 0
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_window = max((len(s) for s in params.stop), default=0)

    def add(self, out: SeqOutput) -> bool:
        """Take the core's new tokens; True when a stop string ended the choice here."""
        params = self.params
        self.token_ids.extend(out.token_ids)
        if out.logprobs is not None and self.logprobs is not None:
            self.logprobs.extend(out.logprobs)
            self.cumulative_logprob += sum(lp.logprob for lp in out.logprobs)
        detokenizer = self.detokenizer
        for token_id in out.token_ids:
            piece = detokenizer.add(token_id)
            if self.stop_window:
                window = self.tail + piece
                self.tail = window[-self.stop_window:]
                if len(self.token_ids) >= params.min_tokens and out.finish_reason in (
                        None, "length"):  # a stop id ends it before any stop string
                    found = find_stop_string(window, len(piece), params.stop,
                                             params.include_stop_str_in_output)
                    if found is not None:
                        self._append(piece)
                        self._cut(len(window) - len(found[1]))
                        self.finish_reason, self.stop_reason = "stop", found[0]
                        return True
            self._append(piece)
        if out.finish_reason is not None:
            self._append(detokenizer.flush())  # an incomplete character left at the end
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return False

    def _append(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            self.pending += piece

    def _cut(self, num_chars: int) -> None:
        """Drop the last num_chars characters of the text (what follows the kept part of a
        stop string); they were never streamed, since a possible stop string is held back."""
        text_len = sum(len(p) for p in self.parts)
        emitted = text_len - len(self.pending)
        left = num_chars
        while left > 0:
            last = self.parts.pop()
            if len(last) > left:
                self.parts.append(last[:len(last) - left])
            left -= min(len(last), left)
        self.pending = self.pending[:max(0, text_len - num_chars - emitted)]

    def delta(self, finished: bool) -> CompletionOutput:
        """What is new since the last delta; the cumulative fields too once `finished`."""
        pending = self.pending
        done = finished or self.finish_reason is not None
        held = (num_holdback_chars(pending, self.params.stop,
                                   self.params.include_stop_str_in_output)
                if self.params.stop and not done else 0)
        delta_text = pending[:len(pending) - held]
        self.pending = pending[len(pending) - held:]
        new_tokens = self.token_ids[self.num_emitted_tokens:]
        self.num_emitted_tokens = len(self.token_ids)
        logprobs = self.logprobs
        delta_logprobs = None
        if logprobs is not None:
            delta_logprobs = logprobs[self.num_emitted_logprobs:]
            self.num_emitted_logprobs = len(logprobs)
        return CompletionOutput(
            index=self.index,
            text="".join(self.parts) if done else "",
            token_ids=self.token_ids if done else [],
            delta_text=delta_text, delta_token_ids=new_tokens,
            logprobs=logprobs if done else None, delta_logprobs=delta_logprobs,
            cumulative_logprob=self.cumulative_logprob if logprobs is not None else None,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class _Request:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "choices", "metrics",
                 "num_cached_tokens", "error", "results", "num_unfinished", "seq_ids")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams | BeamSearchParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.choices: list[_Choice] = (
            [_Choice(i, params, tokenizer) for i in range(params.n)]
            if isinstance(params, SamplingParams) else [])
        self.num_unfinished = len(self.choices)
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.results: list[CompletionOutput] | None = None  # beams, once done
        self.seq_ids: dict[int, str] = {}  # choice index -> its sequence in the core

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        if isinstance(self.params, BeamSearchParams):
            return self.results is not None
        return self.num_unfinished == 0

    def output(self, touched: Collection[_Choice], finish_reason: str | None = None
               ) -> RequestOutput:
        if finish_reason is not None:  # aborted or failed: every open choice ends now
            for choice in self.choices:
                if choice.finish_reason is None:
                    choice.finish_reason = finish_reason
            touched = self.choices
        finished = self.finished or finish_reason is not None
        if finished and self.metrics.finished_time is None:
            self.metrics.finished_time = time.monotonic()
        if self.results is not None:
            outputs = self.results
        elif finished:
            outputs = [c.delta(True) for c in self.choices]
        else:
            outputs = [c.delta(False) for c in touched]
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

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams | BeamSearchParams) -> None:
        self._requests[request_id] = _Request(request_id, prompt, prompt_token_ids, params,
                                              self.tokenizer)

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
            request.results = [CompletionOutput(
                index=i, text=decode(ids), token_ids=ids, delta_text="", delta_token_ids=[],
                logprobs=None, delta_logprobs=None, cumulative_logprob=None,
                finish_reason="abort", stop_reason=None) for i, ids in enumerate(live_beams or [])]
        return request.output((), "abort")

    def process(self, step: StepOutput, stop_seq: Callable[[str], None],
                fail_request: Callable[[str], object]) -> list[RequestOutput]:
        """One step's records -> outputs. `stop_seq(seq_id)` ends a sequence whose stop string
        appeared; `fail_request(request_id)` ends a request whose processing raised."""
        requests = self._requests
        touched: dict[str, tuple[_Request, dict[int, _Choice]]] = {}
        for out in step.seqs:
            request = requests.get(out.request_id)
            if request is None or request.error is not None:
                continue  # aborted meanwhile, or failed earlier in this step
            entry = touched.get(out.request_id)
            if entry is None:
                entry = touched[out.request_id] = (request, {})
                if request.metrics.first_token_time is None:
                    request.metrics.first_token_time = time.monotonic()
                    request.metrics.first_scheduled_time = out.first_scheduled_time
                    request.num_cached_tokens = out.num_cached_tokens
            try:
                choice = request.choices[out.index]
                if choice.finish_reason is not None:
                    continue  # ended by a stop string; the core computed one token more
                request.seq_ids[out.index] = out.seq_id
                if out.num_draft_tokens:  # only n = 1 speculates: the request's own counts
                    request.metrics.num_draft_tokens = out.num_draft_tokens
                    request.metrics.num_accepted_tokens = out.num_accepted_tokens
                if choice.add(out):
                    stop_seq(out.seq_id)
                if choice.finish_reason is not None:
                    request.num_unfinished -= 1
                entry[1][out.index] = choice
            except Exception as e:
                log.error("request failed", request_id=out.request_id,
                          stage="output processing", error=f"{type(e).__name__}: {e}")
                request.error = f"output processing failed: {type(e).__name__}: {e}"
                fail_request(out.request_id)
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
                outputs.append(request.output((), "error"))
            else:
                outputs.append(request.output(choices.values()))
            if outputs[-1].finished:
                del requests[request_id]
        return outputs

    def _beam_results(self, request: _Request, hyps: list[BeamHypothesis]
                      ) -> list[CompletionOutput]:
        params = request.params
        assert isinstance(params, BeamSearchParams)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        decode = self.tokenizer.decode
        return [CompletionOutput(
            index=i, text=decode(list(hyp.token_ids)), token_ids=list(hyp.token_ids),
            delta_text="", delta_token_ids=[], logprobs=None, delta_logprobs=None,
            cumulative_logprob=hyp.cum_logprob,
            finish_reason="stop" if hyp.token_ids[-1] in stop_ids else "length",
            stop_reason=(hyp.token_ids[-1] if hyp.token_ids[-1] in params.stop_token_ids
                         else None)) for i, hyp in enumerate(hyps)]

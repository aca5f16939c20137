"""A user request as the engine sees it: its n sampled choices (or its beams) and its outputs."""

from __future__ import annotations

import time

import numpy as np

from kvcore.request import CompletionOutput, Request, RequestMetrics, RequestOutput
from kvcore.sampling import BeamSearch, SamplingParams


class RequestGroup:
    """The sequences of one user request. With n > 1 the first sequence prefills the prompt
    alone; when it samples its first token the engine forks n - 1 more sequences from it (they
    share the prompt's blocks by refcount). A beam search keeps its live beams in `members`, in
    the order BeamSearch knows them, and reports its hypotheses once it is done."""

    def __init__(self, first: Request, beam: BeamSearch | None = None) -> None:
        self.request_id = first.request_id
        self.first = first
        self.members: list[Request] = [first]  # n choices by index; beams: the live beams
        self.num_choices = first.params.n if isinstance(first.params, SamplingParams) else 1
        self.forked = self.num_choices == 1
        self.beam = beam
        self.pending: dict[str, np.ndarray] = {}  # beam seq id -> its logits row of this step
        self.beam_outputs: list[CompletionOutput] | None = None  # set when the search is done
        self.num_forks = 0  # beams forked so far: unique sequence ids
        self.aborted = False
        self.error: str | None = None  # why the engine failed this request (finished)
        self.finished_time: float | None = None

    @property
    def finished(self) -> bool:
        if self.aborted or self.error is not None:
            return True
        if self.beam is not None:
            return self.beam_outputs is not None
        return self.forked and all(m.finished for m in self.members)

    def output(self) -> RequestOutput:
        """The outputs so far; each choice's delta covers what changed since the last call."""
        first = self.first
        if self.beam is not None and self.beam_outputs is not None:
            outputs = self.beam_outputs
        elif self.beam is not None and not self.aborted and self.error is None:
            outputs = []  # a beam search reports once, when it is done
        else:  # the choices (or, aborted, the live beams as they were: reason "abort")
            outputs = [m.completion() for m in self.members]
        metrics = first.metrics
        finished = self.finished
        if finished and self.finished_time is None:
            self.finished_time = time.monotonic()  # the last of its sequences just ended
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=RequestMetrics(metrics.arrival_time, metrics.first_scheduled_time,
                                   metrics.first_token_time, self.finished_time),
            error=self.error,
        )

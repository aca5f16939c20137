"""The engine requests of one API call: merged outputs, choices, abort."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvcore.config import ParamError
from kvcore.engine import RequestFailed
from kvcore.request import RequestOutput
from kvcore.sampling.params import BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.service.admission import Reservation
from kvcore.service.errors import APIError, bad_request
from kvcore.service.protocol import GenerationRequest


@dataclass(slots=True)
class Job:
    """One engine request: a prompt of the API call with its n choices."""

    index: int  # the prompt's position in the call
    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str
    params: SamplingParams | BeamSearchParams
    num_cached_tokens: int = 0
    finished: bool = False
    last_output: RequestOutput | None = None
    last_token_time: float | None = None


@dataclass(slots=True)
class Choice:
    """What the client has been sent for one choice (index = prompt index * n + choice)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: characters before the next token
    started: bool = False  # the first chunk (chat role, echoed prompt) went out


@dataclass(frozen=True, slots=True)
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None


def build_params(req: GenerationRequest, room: int) -> SamplingParams | BeamSearchParams:
    """The engine parameters of one prompt (a 400 naming the parameter when they are invalid);
    the engine checks them against the context when the request is added. `room`: what the
    context leaves after the prompt, a beam search's max_tokens when the call names none."""
    try:
        if req.use_beam_search:
            if req.logprobs is not None:
                raise bad_request("logprobs are not available with beam search", "logprobs")
            max_tokens = req.max_tokens if req.max_tokens is not None else max(room, 1)
            beams = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens,
                                     length_penalty=req.length_penalty,
                                     early_stopping=req.early_stopping,
                                     ignore_eos=req.sampling["ignore_eos"],
                                     stop_token_ids=req.sampling["stop_token_ids"],
                                     constraint=req.sampling.get("constraint"))
            min_tokens = req.sampling["min_tokens"]  # SamplingParams' own check, for beams
            if req.max_tokens is not None and min_tokens > req.max_tokens:
                raise ParamError("min_tokens", f"min_tokens must be <= max_tokens "
                                 f"({req.max_tokens}), got {min_tokens}")
            return beams
        return SamplingParams(n=req.n, max_tokens=req.max_tokens, logprobs=req.logprobs,
                              **req.sampling)
    except ParamError as e:
        # the body's names: n is the beam width; chat's max_completion_tokens is max_tokens
        param = {"beam_width": "n", "max_tokens": req.max_tokens_param}.get(e.param, e.param)
        raise bad_request(str(e), param) from None


class Generation:
    """Drives the engine requests of one call and folds their outputs into per-choice deltas."""

    def __init__(self, engine: Any, req: GenerationRequest, jobs: list[Job], cache_salt: str,
                 on_token_gap: Any) -> None:
        self.engine = engine
        self.req = req
        self.jobs = jobs
        self.cache_salt = cache_salt
        self.choices = [Choice(index=i) for i in range(len(jobs) * req.n)]
        self._on_token_gap = on_token_gap
        self._queue: asyncio.Queue[tuple[Job, RequestOutput | None, BaseException | None]] = (
            asyncio.Queue())
        self._tasks: list[asyncio.Task[None]] = []
        self._reservation: Reservation | None = None

    async def _pump(self, job: Job) -> None:
        try:
            async for output in self.engine.generate(job.prompt_token_ids, job.params,
                                                     job.request_id, priority=self.req.priority,
                                                     cache_salt=self.cache_salt):
                self._queue.put_nowait((job, output, None))
            self._queue.put_nowait((job, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which decides 400 or in-stream error
            self._queue.put_nowait((job, None, e))
        finally:  # the engine request ended: its sequences no longer wait
            if self._reservation is not None:
                self._reservation.release(self.req.n)

    def start(self, reservation: Reservation) -> None:
        """Run the engine requests; `reservation` (the call's admitted sequences) is released
        as they end, and in full at close()."""
        self._reservation = reservation
        self._tasks = [asyncio.create_task(self._pump(job)) for job in self.jobs]

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """The new text of every choice, one list per engine output; ValueError -> APIError 400."""
        remaining = len(self.jobs)
        while remaining:
            job, output, error = await self._queue.get()
            if output is None:
                remaining -= 1
                # refusals come before any output; a failure later is the server's fault
                if isinstance(error, ValueError) and job.last_output is None:
                    param = getattr(error, "param", None) or "prompt"
                    if param == "prompt" and self.req.kind == "chat":
                        param = "messages"
                    raise bad_request(str(error), param)
                if isinstance(error, RequestFailed):
                    raise APIError(500, f"generation failed: {error}")
                if error is not None:
                    raise error
                continue
            deltas = self._fold(job, output)
            if deltas:
                yield deltas

    def _fold(self, job: Job, output: RequestOutput) -> list[Delta]:
        job.last_output = output
        job.num_cached_tokens = output.num_cached_tokens
        job.finished = output.finished
        beam = self.req.use_beam_search
        if beam and not output.finished:
            return []  # beams reorder while they run: only the final ranking is an answer
        now = time.monotonic()
        deltas = []
        for position, completion in enumerate(output.outputs[: self.req.n]):
            choice = self.choices[job.index * self.req.n + (position if beam else
                                                            completion.index)]
            if choice.finish_reason is not None:
                continue  # ended earlier (the final output repeats every choice): sent once
            if beam:
                text, token_ids = completion.text, list(completion.token_ids)
                logprobs: list[TokenLogprob] = []
            else:
                text, token_ids = completion.delta_text, list(completion.delta_token_ids)
                logprobs = list(completion.delta_logprobs or [])
            choice.text += text
            choice.token_ids += token_ids
            choice.logprobs += logprobs
            choice.finish_reason = completion.finish_reason
            choice.stop_reason = completion.stop_reason
            if text or token_ids or completion.finish_reason is not None:
                deltas.append(Delta(choice, text, token_ids, logprobs, completion.finish_reason))
        if any(d.token_ids for d in deltas):
            if job.last_token_time is not None:
                self._on_token_gap(now - job.last_token_time)
            job.last_token_time = now
        return deltas

    async def abort(self) -> None:
        """Abort every unfinished request: each stream ends with finish_reason "abort"."""
        for job in self.jobs:
            if not job.finished:
                await self.engine.abort(job.request_id)

    async def close(self) -> None:
        """Cancel the pumps (which aborts their requests) and abort what is still running."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reservation is not None:
            self._reservation.close()
        for job in self.jobs:
            if not job.finished:
                await self.engine.abort(job.request_id)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(job.prompt_token_ids) for job in self.jobs)
        completion = sum(len(choice.token_ids) for choice in self.choices)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": sum(j.num_cached_tokens
                                                               for j in self.jobs)}}


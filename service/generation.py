"""The engine requests of one API call: started, merged into one stream of outputs, aborted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvcore.engine import EngineClient, RequestFailed
from kvcore.request import RequestOutput
from kvcore.sampling.params import BeamSearchParams, SamplingParams
from kvcore.service.admission import Reservation
from kvcore.service.errors import APIError, bad_request


@dataclass(slots=True)
class Job:
    """One engine request: a prompt of the API call with its n choices."""

    index: int  # the prompt's position in the call
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    stream: AsyncIterator[RequestOutput] | None = None  # the engine's outputs, once checked
    last_output: RequestOutput | None = None
    num_generated: int = 0  # tokens of its choices so far (usage, metrics)
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.last_output is not None and self.last_output.finished


class Generation:
    """Drives the engine requests of one call; `outputs()` yields them as they come."""

    def __init__(self, engine: EngineClient, jobs: list[Job], num_choices: int,
                 on_token_gap: Callable[[float], None]) -> None:
        self.engine = engine
        self.jobs = jobs
        self.n = num_choices  # per prompt
        self._on_token_gap = on_token_gap
        self._queue: asyncio.Queue[tuple[Job, RequestOutput | None, BaseException | None]] = (
            asyncio.Queue())
        self._tasks: list[asyncio.Task[None]] = []
        self._reservation: Reservation | None = None

    def check(self, priority: int, cache_salt: str) -> None:
        """Hand each prompt to the engine, which checks it against the context (a 400 naming
        the parameter) before anything is queued or admitted."""
        for job in self.jobs:
            try:
                job.stream = self.engine.generate(job.prompt_token_ids, job.params,
                                                  job.request_id, priority=priority,
                                                  cache_salt=cache_salt)
            except ValueError as e:
                raise _refusal(e) from None

    async def _pump(self, job: Job) -> None:
        assert job.stream is not None
        try:
            async for output in job.stream:
                self._queue.put_nowait((job, output, None))
            self._queue.put_nowait((job, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which decides 400 or in-stream error
            self._queue.put_nowait((job, None, e))
        finally:  # the engine request ended: its sequences no longer wait
            if self._reservation is not None:
                self._reservation.release(self.n)

    def start(self, reservation: Reservation) -> None:
        """Run the engine requests; `reservation` (the call's admitted sequences) is released
        as they end, and in full at close()."""
        self._reservation = reservation
        self._tasks = [asyncio.create_task(self._pump(job)) for job in self.jobs]

    async def outputs(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Every engine output of the call; an engine refusal is a 400, a failure a 500."""
        remaining = len(self.jobs)
        while remaining:
            job, output, error = await self._queue.get()
            if output is None:
                remaining -= 1
                # refusals come before any output; a failure later is the server's fault
                if isinstance(error, ValueError) and job.last_output is None:
                    raise _refusal(error)
                if isinstance(error, RequestFailed):
                    raise APIError(500, f"generation failed: {error}")
                if error is not None:
                    raise error
                continue
            job.last_output = output
            if isinstance(job.params, BeamSearchParams):  # only the final ranking counts
                job.num_generated = sum(len(c.token_ids) for c in output.outputs[:self.n])
            else:
                num_new = sum(len(c.delta_token_ids) for c in output.outputs)
                if num_new:
                    now = time.monotonic()
                    if job.last_token_time is not None:
                        self._on_token_gap(now - job.last_token_time)
                    job.last_token_time = now
                    job.num_generated += num_new
            yield job, output

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
        for job in self.jobs:  # (a stream never started queued nothing: no abort needed)
            if self._tasks and not job.finished:
                await self.engine.abort(job.request_id)

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(job.prompt_token_ids) for job in self.jobs)
        completion = sum(job.num_generated for job in self.jobs)
        cached = sum(j.last_output.num_cached_tokens for j in self.jobs if j.last_output)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _refusal(error: ValueError) -> APIError:
    """The engine's refusal (a ParamError names the parameter) as a 400."""
    return bad_request(str(error), getattr(error, "param", None) or "prompt")

"""One API call: what its body asked for, translated once, and its engine requests' progress.

A protocol's parser builds the Call (service.protocol for OpenAI's chat and completions); the
routes submit it to the engine, run it, and hand its deltas to the protocol's formatter. The
Call is the service's one record of a call: its prompts, params and wire options, then per
prompt the engine's stream and last output, and per choice how it finished (and, for a whole
answer, its text and logprobs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvcore.engine import EngineClient, RequestFailed
from kvcore.request import CompletionOutput, RequestOutput
from kvcore.sampling.params import BeamSearchParams, SamplingParams, TokenLogprob
from kvcore.service.admission import Reservation
from kvcore.service.errors import APIError, bad_request
from kvcore.service.tool_format import FALLBACK, ToolFormat
from kvcore.service.tools import ToolRequest

Prompt = str | list[int]


@dataclass(eq=False, slots=True)
class Call:
    kind: str  # the protocol's name for it ("chat", "completion")
    model: str | None
    prompts: list[Prompt]  # completions: one or more; chat: empty (see messages)
    messages: list[dict[str, Any]]  # chat only
    add_generation_prompt: bool
    params: SamplingParams | BeamSearchParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    tools: ToolRequest | None = None  # chat with tools (tool_choice other than "none")
    tool_format: ToolFormat = FALLBACK  # chat: the template's, how messages and calls render
    keep_texts: bool = False  # streamed too: its answer is checked after generation
    # --- progress, once submitted ---
    call_id: str = ""
    prompt_ids: list[list[int]] = field(default_factory=list)  # per prompt, tokenized
    last: list[RequestOutput | None] = field(default_factory=list)  # per prompt
    num_generated: list[int] = field(default_factory=list)  # per prompt: tokens (usage)
    finish_reasons: dict[int, str] = field(default_factory=dict)  # per choice index
    stop_reasons: dict[int, int | str | None] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)  # a whole answer's, per choice
    choice_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    _engine: EngineClient | None = None
    _streams: list[AsyncIterator[RequestOutput]] = field(default_factory=list)
    _queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = field(
        default_factory=asyncio.Queue)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _reservation: Reservation | None = None

    @property
    def n(self) -> int:
        return self.params.num_seqs

    @property
    def num_seqs(self) -> int:
        """Sequences the call runs: prompts x n."""
        return max(len(self.prompts), 1) * self.n

    @property
    def request_ids(self) -> list[str]:
        return [f"{self.call_id}-{i}" for i in range(len(self.prompt_ids))]

    def submit(self, engine: EngineClient, cache_salt: str) -> None:
        """Hand each prompt to the engine, which checks it against the context and its own
        size (a 400 naming the parameter) before anything is queued or admitted."""
        self._engine = engine
        self.last = [None] * len(self.prompt_ids)
        self.num_generated = [0] * len(self.prompt_ids)
        for ids, request_id in zip(self.prompt_ids, self.request_ids, strict=True):
            try:
                self._streams.append(engine.generate(ids, self.params, request_id,
                                                     priority=self.priority,
                                                     cache_salt=cache_salt))
            except ValueError as e:
                raise _refusal(e) from None

    def start(self, reservation: Reservation, on_token_gap: Callable[[float], None]) -> None:
        """Run the engine requests; `reservation` (the call's admitted sequences) is released
        as they end, and in full at close()."""
        self._reservation = reservation
        self._tasks = [asyncio.create_task(self._pump(i, stream, on_token_gap))
                       for i, stream in enumerate(self._streams)]

    async def _pump(self, prompt: int, stream: AsyncIterator[RequestOutput],
                    on_token_gap: Callable[[float], None]) -> None:
        last_token_time = None
        try:
            async for output in stream:
                if any(c.token_ids for c in output.outputs):
                    now = time.monotonic()
                    if last_token_time is not None:
                        on_token_gap(now - last_token_time)
                    last_token_time = now
                self._queue.put_nowait((prompt, output, None))
            self._queue.put_nowait((prompt, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # handed to the consumer, which decides 400 or in-stream error
            self._queue.put_nowait((prompt, None, e))
        finally:  # the engine request ended: its sequences no longer wait
            if self._reservation is not None:
                self._reservation.release(self.n)

    async def deltas(self) -> AsyncIterator[list[CompletionOutput]]:
        """Each engine output's choices (what changed), as the engine produces them, indexed in
        the call (prompt index x n + choice; beams by rank); an engine refusal is a 400, a
        failure a 500. A whole answer (not streamed) is kept in `texts` and `choice_logprobs`."""
        remaining = len(self._tasks)
        while remaining:
            prompt, output, error = await self._queue.get()
            if output is None:
                remaining -= 1
                # refusals come before any output; a failure later is the server's fault
                if isinstance(error, ValueError) and self.last[prompt] is None:
                    raise _refusal(error)
                if isinstance(error, RequestFailed):
                    raise APIError(500, f"generation failed: {error}")
                if error is not None:
                    raise error
                continue
            self.last[prompt] = output
            for c in output.outputs:
                c.index = index = prompt * self.n + c.index  # (the output is the call's own)
                self.num_generated[prompt] += len(c.token_ids)
                if c.finish_reason is not None:
                    self.finish_reasons[index] = c.finish_reason
                    self.stop_reasons[index] = c.stop_reason
                if not self.stream or self.keep_texts:
                    self.texts.setdefault(index, []).append(c.text)
                    if c.logprobs:
                        self.choice_logprobs.setdefault(index, []).extend(c.logprobs)
            yield output.outputs

    async def abort(self) -> None:
        """Abort every unfinished request: each stream ends with finish_reason "abort"."""
        assert self._engine is not None
        for request_id, last in zip(self.request_ids, self.last, strict=True):
            if last is None or not last.finished:
                await self._engine.abort(request_id)

    async def close(self) -> None:
        """Cancel the pumps (which aborts their requests) and abort what is still running."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._reservation is not None:
            self._reservation.close()
        if self._tasks:  # (a stream never started queued nothing: no abort needed)
            await self.abort()

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(self.num_generated)
        cached = sum(last.num_cached_tokens for last in self.last if last is not None)
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _refusal(error: ValueError) -> APIError:
    """The engine's refusal (a ParamError names the parameter) as a 400."""
    return bad_request(str(error), getattr(error, "param", None) or "prompt")

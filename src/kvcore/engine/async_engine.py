"""AsyncEngine: an asyncio task drives the Engine; each step's compute runs in a worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import structlog

from kvcore.config import EngineConfig
from kvcore.engine.engine import Engine
from kvcore.engine.kv_snapshot import KVProbe
from kvcore.engine.setup import check_prompt
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams | BeamSearchParams
    priority: int
    cache_salt: str | None
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """For asyncio programs (and the service): `async with AsyncEngine(engine) as ae:` then
    `async for out in ae.generate(prompt, params): ...`.

    Only the driver task touches the engine, and only between steps or inside the step it runs in
    the single worker thread, so engine state has one owner at a time. Adds and aborts queue up and
    are applied between steps; each request's outputs go to its own asyncio.Queue.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        self._kv_probe = KVProbe()  # the KV inspector hook, see kv_snapshot() below

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + len(self._adds)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.running:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcore-step")
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._drive(), name="kvcore-engine")

    async def stop(self) -> None:
        """Stop the driver; unfinished requests end with finish_reason "abort"."""
        task, executor = self._task, self._executor
        self._task = None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if executor is not None:
            # a step still running in the worker must end before anyone touches the engine
            await asyncio.get_running_loop().run_in_executor(executor, lambda: None)
            executor.shutdown()
            self._executor = None
        for add in self._adds:
            add.queue.put_nowait(RuntimeError("the engine stopped"))
        self._adds.clear()
        self._aborts.extend(self._queues)
        self._apply_aborts()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses (the last one has finished=True).
        Validation errors raise ValueError on the first __anext__; cancelling the consumer or
        closing the iterator aborts the request."""
        return self._generate(prompt, params, request_id or uuid.uuid4().hex, priority,
                              cache_salt)

    async def _generate(self, prompt: str | Sequence[int],
                        params: SamplingParams | BeamSearchParams, request_id: str,
                        priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        if not self.running or self._wakeup is None:
            raise RuntimeError("AsyncEngine is not started (use `async with` or start())")
        engine = self.engine
        prompt_ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # the checks that need no engine state run here, so bad input fails at once
        check_prompt(prompt_ids, params, engine.max_model_len, engine.model_config.vocab_size,
                     engine.kv)
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self._adds.append(_Add(request_id, prompt if isinstance(prompt, str) else None,
                               prompt_ids, params, priority, cache_salt, queue))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._aborts.append(request_id)
                self._wakeup.set()
            self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request between steps; its consumer gets a final output with reason abort."""
        self._aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    # --- the driver task ---

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            self._apply_adds()
            self._apply_aborts()
            if not engine.has_unfinished_requests():
                await self._kv_tick(loop)
                with contextlib.suppress(TimeoutError):  # idle: still one series sample a second
                    await asyncio.wait_for(self._wakeup.wait(), 1.0)
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, engine.step)
            except Exception as e:  # a failed step fails its requests, not the driver
                log.exception("engine step failed")
                for queue in self._queues.values():
                    queue.put_nowait(e)
                self._aborts.extend(self._queues)
                continue
            for output in outputs:
                consumer = self._queues.get(output.request_id)
                if consumer is not None:
                    consumer.put_nowait(output)
            self._kv_probe.count(outputs)
            await self._kv_tick(loop)
            await asyncio.sleep(0)  # let consumers run before the next step

    # --- the KV inspector hook (kvcore.engine.kv_snapshot): published between steps ---

    def kv_snapshot(self) -> dict[str, Any] | None:
        """The last published KV snapshot (None before the first). Polling it keeps the driver
        publishing fresh ones, at most every 0.5 s; the caller never reads engine state."""
        snapshot = self._kv_probe.poll()
        if self._kv_probe.due() and self._wakeup is not None:
            self._wakeup.set()  # an idle driver publishes now
        return snapshot

    async def _kv_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        probe = self._kv_probe
        probe.history.maybe_sample(self.engine, time.monotonic())  # O(1), at most 1 Hz
        if probe.due():  # in the step thread: the one place engine state is touched
            await loop.run_in_executor(self._executor, probe.publish, self.engine)

    def _apply_adds(self) -> None:
        adds, self._adds = self._adds, []
        for add in adds:
            if self._queues.get(add.request_id) is not add.queue:
                continue  # the consumer went away before its request was added
            try:
                self.engine.add_request(add.request_id, add.prompt_ids, add.params,
                                        priority=add.priority, cache_salt=add.cache_salt,
                                        prompt_text=add.prompt)
            except ValueError as e:
                add.queue.put_nowait(e)

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            output = self.engine.abort_request(request_id)
            queue = self._queues.get(request_id)
            if output is not None and queue is not None:
                queue.put_nowait(output)

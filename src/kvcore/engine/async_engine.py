"""AsyncEngine: an asyncio task drives the Engine; each step's compute runs in a worker thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import structlog

from kvcore.cache import CacheEvent
from kvcore.config import EngineConfig, ModelConfig, ParamError
from kvcore.engine.engine import Engine, EngineStats
from kvcore.engine.fair_queue import FairQueue
from kvcore.engine.kv_snapshot import KVProbe
from kvcore.model.tokenizer import Tokenizer
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams
from kvcore.sampling.constraints import DEFAULT_TENANT, Compiled, Constraint

log = structlog.get_logger(__name__)
_INLINE_CHARS = 8192  # shorter prompt texts are tokenized on the event loop


class RequestFailed(RuntimeError):
    """The engine failed this request (its sampling, output processing, or the forward pass of
    its step); other requests go on. Raised by the stream of `AsyncEngine.generate`."""


class _Stream:
    """One request between the event loop and the driver: what the driver adds between steps,
    then the consumer's outputs (a list and, while the consumer waits, a future to wake it). A
    step hands over with one append (and at most one wake-up), cheaper than an asyncio.Queue."""

    __slots__ = ("request_id", "prompt", "prompt_ids", "params", "max_tokens", "priority",
                 "cache_salt", "prepared", "items", "waiter")

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams | BeamSearchParams, max_tokens: int, priority: int,
                 cache_salt: str | None, prepared: Compiled | None = None) -> None:
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.params, self.max_tokens = params, max_tokens
        self.priority, self.cache_salt = priority, cache_salt
        # the compiled constraint, held while the request lives: it stays findable for the
        # driver's add_checked (never compiled there, whatever the cache evicts meanwhile)
        self.prepared = prepared
        self.items: list[RequestOutput | BaseException] = []
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncEngine:
    """For asyncio programs (and the service): `async with AsyncEngine(engine) as ae:` then
    `async for out in ae.generate(prompt, params): ...`.

    Only the driver task touches the engine, and only between steps or inside the step it runs in
    the single worker thread, so engine state has one owner at a time. Adds and aborts queue up and
    are applied between steps; each request's outputs go to its own stream.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._adds: list[_Stream] = []  # to add between steps
        self._aborts: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None
        # sequences waiting in the scheduler, published by the driver after each step (the event
        # loop never reads scheduler state while a step may be running)
        self._num_waiting_seqs = 0
        self._stats: EngineStats = engine.stats()
        self._kv_probe = KVProbe()  # the KV inspector hook, see kv_snapshot() below
        # tenants take turns at the constraint compile workers
        self._compile_turns = FairQueue(engine.constraints.pool.num_workers)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    # --- the read-only surface (immutable after construction, safe from the event loop) ---

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The engine's counters as of the last step (published by the driver between steps)."""
        return self._stats

    def enable_cache_events(self) -> None:
        """Start recording the pool's prefix-cache changes (before the first request)."""
        self.engine.kv.pool.enable_events()

    def drain_cache_events(self) -> list[CacheEvent]:
        """The pool's cache changes since the last drain (thread-safe against a running step)."""
        return self.engine.kv.pool.drain_events()

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run: the scheduler's (as of the last step) and those queued to
        be added (n > 1 and beams count every sequence)."""
        return self._num_waiting_seqs + sum(_num_seqs(stream.params) for stream in self._adds)

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
        # the constraint compiler's GIL-holding set-up, now rather than mid-serving
        threading.Thread(target=self.engine.constraints.warm, name="kvcore-warm",
                         daemon=True).start()
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
        for stream in self._adds:
            stream.put(RuntimeError("the engine stopped"))
        self._adds.clear()
        self._aborts.extend(self._streams)
        self._apply_aborts()
        self._publish()

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses (the last one has finished=True).
        The request is checked once, here: a refusal (ParamError, a ValueError naming the
        parameter) raises from this call for token ids, so a server refuses bad input before
        it queues anything, and on the first __anext__ for a text (tokenized first) or for a
        constraint `prepare` did not compile yet (compiled then, off the event loop).
        Cancelling the consumer or closing the iterator aborts the request."""
        prompt_ids: list[int] | None = None
        max_tokens: int | None = None  # None: checked on the first __anext__
        if not isinstance(prompt, str):
            prompt_ids = list(prompt)
            if params.constraint is None or self.engine.constraints.lookup(params.constraint,
                                                                           cache_salt):
                max_tokens = self.engine.check_request(prompt_ids, params, priority, cache_salt)
        return self._generate(prompt, prompt_ids, max_tokens, params,
                              request_id or uuid.uuid4().hex, priority, cache_salt)

    async def _generate(self, prompt: str | Sequence[int], prompt_ids: list[int] | None,
                        max_tokens: int | None,
                        params: SamplingParams | BeamSearchParams, request_id: str,
                        priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        if not self.running or self._wakeup is None:
            raise RuntimeError("AsyncEngine is not started (use `async with` or start())")
        if prompt_ids is None:  # a long text tokenizes off the event loop
            assert isinstance(prompt, str)
            encode = self.engine.tokenizer.encode
            prompt_ids = (encode(prompt) if len(prompt) < _INLINE_CHARS
                          else await asyncio.to_thread(encode, prompt))
        prepared = await self.prepare(params.constraint, cache_salt or DEFAULT_TENANT,
                                      cache_salt)
        if max_tokens is None:
            max_tokens = self.engine.check_request(prompt_ids, params, priority, cache_salt)
        # what depends on the engine's state (request ids, max_num_seqs) is checked by
        # Engine.add_checked when the driver adds the request: out of the first __anext__
        if request_id in self._streams:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        stream = _Stream(request_id, prompt if isinstance(prompt, str) else None, prompt_ids,
                         params, max_tokens, priority, cache_salt, prepared)
        self._streams[request_id] = stream
        self._adds.append(stream)
        self._wakeup.set()
        loop = asyncio.get_running_loop()
        finished = False
        try:
            while True:
                if not stream.items:
                    stream.waiter = loop.create_future()
                    await stream.waiter
                    stream.waiter = None
                items, stream.items = stream.items, []
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    finished = item.finished
                    if item.error is not None:
                        raise RequestFailed(item.error)
                    yield item
                    if finished:
                        return
        finally:
            if not finished:
                self._aborts.append(request_id)
                self._wakeup.set()
            self._streams.pop(request_id, None)

    async def prepare(self, constraint: Constraint | None, tenant: str = DEFAULT_TENANT,
                      cache_salt: str | None = None) -> Compiled | None:
        """Compile a request's constraint before `generate`, off the event loop and off the
        engine step: bounded, compiled in a worker process, then here on a compile thread
        (kvcore.sampling.constraints.ConstraintCompiler); tenants take turns at the workers.
        ParamError naming the field when it is refused. The result, while referenced, keeps the
        compiled grammar findable for `generate` (same `cache_salt`); a cache hit returns at
        once. The one call every API's constraints go through."""
        if constraint is None:
            return None
        compiler = self.engine.constraints
        compiled = compiler.lookup(constraint, cache_salt)
        if compiled is not None:
            return compiled
        await self._compile_turns.acquire(tenant)
        try:
            return await asyncio.wrap_future(compiler.submit(constraint, tenant, cache_salt))
        finally:
            self._compile_turns.release()

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
            self._publish()
            if not engine.has_unfinished_requests():
                await self._kv_tick(loop)
                with contextlib.suppress(TimeoutError):  # idle: still one series sample a second
                    await asyncio.wait_for(self._wakeup.wait(), 1.0)
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, engine.step)
            except Exception as e:
                # Engine.step contains the failures it can attribute; one that escapes is a bug
                # in shared state: end every request (and free its blocks) rather than go on
                log.exception("engine step failed")
                for request_id, stream in list(self._streams.items()):
                    engine.abort_request(request_id)
                    stream.put(RequestFailed(f"engine step failed: {type(e).__name__}"))
                continue
            self._publish()
            streams = self._streams
            for output in outputs:
                consumer = streams.get(output.request_id)
                if consumer is not None:
                    consumer.put(output)
            self._kv_probe.count(outputs)
            await self._kv_tick(loop)
            await asyncio.sleep(0)  # let consumers run before the next step

    # --- the KV inspector hook (kvcore.engine.kv_snapshot): published between steps ---

    async def kv_snapshot(self, replica_id: str | None = None) -> dict[str, Any] | None:
        """The last published KV snapshot (None before the first). Polling it keeps the driver
        publishing fresh ones, at most every 0.5 s; the caller never reads engine state. One
        engine: there is no replica to name."""
        if replica_id is not None:
            raise ParamError("replica", "this engine has no replicas")
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
        for s in adds:
            if self._streams.get(s.request_id) is not s:
                continue  # the consumer went away before its request was added
            try:
                self.engine.add_checked(s.request_id, s.prompt_ids, s.params, s.max_tokens,
                                        priority=s.priority, cache_salt=s.cache_salt,
                                        prompt_text=s.prompt)
            except ValueError as e:
                s.put(e)

    def _publish(self) -> None:
        """Between steps (the worker is idle): the figures the event loop may read."""
        self._stats = self.engine.stats()
        self._num_waiting_seqs = self._stats.num_waiting

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            output = self.engine.abort_request(request_id)
            stream = self._streams.get(request_id)
            if output is not None and stream is not None:
                stream.put(output)


def _num_seqs(params: SamplingParams | BeamSearchParams) -> int:
    return params.n if isinstance(params, SamplingParams) else params.beam_width

"""ClusterEngine: the EngineClient (kvcore.engine) over Ray Serve replicas, for kvcore.service.

`make_app` runs unchanged on it (same routes, SSE and msgpack, auth, tenants, error shapes): the
ingress validates, tokenizes and applies the tenant's cache salt as `kvcore serve` does, then each
generate() becomes one streaming call on the replicas' DeploymentHandle, which the request router
(kvcore.cluster.router) sends to the replica that holds the most of the prompt's blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog

from kvcore.cache import chain_hashes
from kvcore.cluster.engine_view import IngressModel
from kvcore.cluster.state import ReplicaReport, Route, RouterState
from kvcore.config import ModelConfig, ParamError
from kvcore.engine import EngineStats, RequestFailed, check_prompt
from kvcore.grammar.native import check_shape
from kvcore.model.tokenizer import Tokenizer
from kvcore.request import CompletionOutput, RequestMetrics, RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams
from kvcore.sampling.constraints import Constraint

log = structlog.get_logger("kvcore.cluster")


class ClusterEngine:
    """An EngineClient over replicas: the model facts come from the ingress's IngressModel, a
    KV snapshot from the replica asked for (`replica_ids`, `kv_snapshot(replica_id)`). A replica
    that dies mid-stream fails only its own requests (RequestFailed: the service ends the
    stream with an error event)."""

    def __init__(self, handle: Any, state: RouterState, model: IngressModel) -> None:
        self._model = model
        self._control = handle  # unary calls (a replica's KV snapshot)
        self._handle = handle.options(stream=True)
        self._state = state
        self._streams: dict[str, Any] = {}  # request_id -> its DeploymentResponseGenerator
        self._aborted: set[str] = set()
        self._running = False

    @property
    def running(self) -> bool:
        return self._running

    @property
    def tokenizer(self) -> Tokenizer:
        return self._model.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._model.model_config

    @property
    def max_model_len(self) -> int:
        return self._model.max_model_len

    @property
    def num_waiting(self) -> int:
        """Sequences waiting on all replicas: the ingress's own count of what it routed and has
        not seen finish, less what the replicas last reported running (RouterState)."""
        return self._state.num_waiting()

    def replica_ids(self) -> list[str]:
        """The live replicas, sorted (the ids /debug/kv?replica= takes)."""
        return sorted(self._state.snapshot())

    async def kv_snapshot(self, replica_id: str | None = None) -> dict[str, Any] | None:
        """That replica's last published KV snapshot (None before its first; the first live
        replica's when None); the request router sends the call to it alone
        (kvcore.cluster.router)."""
        if replica_id is None:
            ids = self.replica_ids()
            if not ids:
                return None
            replica_id = ids[0]
        snapshot: dict[str, Any] | None = await self._control.kv_snapshot.remote(
            target_replica=replica_id)
        return snapshot

    async def start(self) -> None:
        self._running = True

    async def stop(self) -> None:
        """Abort every open stream (the replicas abort their requests); replicas stay up."""
        self._running = False
        for request_id in list(self._streams):
            await self.abort(request_id)

    def stats(self) -> EngineStats | None:
        """The replicas' last reports summed (usage: the mean), for the engine gauges."""
        reports = [r.stats for r in self._state.snapshot().values() if r.stats is not None]
        if not reports:
            return None
        first = reports[0]
        return EngineStats(
            num_running=sum(s.num_running for s in reports),
            num_waiting=sum(s.num_waiting for s in reports),
            kv_cache_usage=sum(s.kv_cache_usage for s in reports) / len(reports),
            num_free_blocks=sum(s.num_free_blocks for s in reports),
            num_blocks=sum(s.num_blocks for s in reports),
            prefix_cache_queries=sum(s.prefix_cache_queries for s in reports),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in reports),
            num_preemptions=sum(s.num_preemptions for s in reports),
            block_size=first.block_size, cache_dtype=first.cache_dtype,
            kv_cache_bytes=sum(s.kv_cache_bytes for s in reports))

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """AsyncEngine.generate's twin: the context and vocabulary checks run here, once (a
        refusal raises from this call for token ids); the pool-size check of n > 1 stays with
        the replica that takes the request."""
        prompt_ids = None
        if not isinstance(prompt, str):
            prompt_ids = list(prompt)
            self._check(prompt_ids, params)
        return self._generate(prompt, prompt_ids, params, request_id or uuid.uuid4().hex,
                              priority, cache_salt)

    def _check(self, prompt_ids: list[int], params: SamplingParams | BeamSearchParams) -> None:
        check_prompt(prompt_ids, params, self.max_model_len, self.model_config.vocab_size, None)

    async def _generate(self, prompt: str | Sequence[int], prompt_ids: list[int] | None,
                        params: SamplingParams | BeamSearchParams, request_id: str,
                        priority: int, cache_salt: str | None) -> AsyncIterator[RequestOutput]:
        if not self._running:
            raise RuntimeError("ClusterEngine is not started")
        if request_id in self._streams:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        if prompt_ids is None:
            assert isinstance(prompt, str)
            prompt_ids = self._model.tokenizer.encode(prompt)
            self._check(prompt_ids, params)
        info = self._model.info
        # the blocks a replica could serve: never the last prompt token (it is recomputed)
        num_blocks = (len(prompt_ids) - 1) // info.block_size if info.prefix_caching else 0
        num_seqs = params.n if isinstance(params, SamplingParams) else params.beam_width
        route = Route(request_id, tuple(chain_hashes(prompt_ids, info.block_size, cache_salt,
                                                     num_blocks)), info.block_size, num_seqs)
        arrival = time.monotonic()
        stream = self._handle.generate.remote(prompt_ids, params, request_id, priority,
                                              cache_salt, route=route)
        self._streams[request_id] = stream
        last: RequestOutput | None = None
        try:
            async for output, report in _items(stream, request_id):
                self._state.apply(report)
                last = output
                yield output
                if output.finished:
                    return
            if request_id in self._aborted:
                yield _aborted(request_id, prompt_ids, params, last, arrival)
                return
            raise RequestFailed("the replica's stream ended without a final output")
        finally:
            self._streams.pop(request_id, None)
            self._aborted.discard(request_id)
            stream.cancel()  # no-op once it finished; else the replica aborts the request
            self._state.finish(request_id, last.num_cached_tokens if last is not None else None)

    async def prepare(self, constraint: Constraint | None, tenant: str = "default",
                      cache_salt: str | None = None) -> None:
        """The constraint's pure-Python bounds, off the event loop (ParamError naming the
        field); the replica that takes the request compiles it (AsyncEngine.prepare)."""
        if constraint is not None:
            await asyncio.to_thread(check_shape, constraint.kind, constraint.spec,
                                    constraint.param)

    async def abort(self, request_id: str) -> None:
        """Cancel the request's stream: the replica aborts it, and the consumer gets a final
        output with finish_reason "abort" (as from AsyncEngine)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._aborted.add(request_id)
            stream.cancel()


async def _items(stream: Any,
                 request_id: str) -> AsyncIterator[tuple[RequestOutput, ReplicaReport]]:
    """The stream's items; Ray's errors become what AsyncEngine raises: the replica's own
    ValueError / RequestFailed as themselves, a dead or unreachable replica as RequestFailed,
    a cancelled stream (abort) as its end."""
    from ray.exceptions import RayError, RayTaskError, TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError

    try:
        async for item in stream:
            yield item
    except (RequestCancelledError, TaskCancelledError, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError) and asyncio.current_task() is not None and (
                asyncio.current_task().cancelling()):  # type: ignore[union-attr]
            raise  # our own consumer was cancelled, not the stream
        return
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, ValueError | RequestFailed):
            raise cause from None
        log.warning("replica failed a request", request_id=request_id, error=type(e).__name__)
        raise RequestFailed(f"the replica failed: {type(cause or e).__name__}") from None
    except RayError as e:  # ActorDiedError, ActorUnavailableError, ...
        log.warning("replica lost mid-stream", request_id=request_id, error=type(e).__name__)
        raise RequestFailed(f"the replica serving this request was lost "
                            f"({type(e).__name__})") from None


def _aborted(request_id: str, prompt_ids: list[int], params: SamplingParams | BeamSearchParams,
             last: RequestOutput | None, arrival: float) -> RequestOutput:
    """The final output of an aborted request: every unfinished choice ends with "abort"."""
    num = params.n if isinstance(params, SamplingParams) else params.beam_width
    previous = {c.index: c for c in last.outputs} if last is not None else {}
    outputs = []
    for index in range(num):
        c = previous.get(index)
        outputs.append(CompletionOutput(
            index=index, text=c.text if c else "", token_ids=list(c.token_ids) if c else [],
            delta_text="", delta_token_ids=[], logprobs=c.logprobs if c else None,
            delta_logprobs=[] if c and c.logprobs is not None else None,
            cumulative_logprob=c.cumulative_logprob if c else None,
            finish_reason=c.finish_reason if c and c.finish_reason else "abort",
            stop_reason=c.stop_reason if c else None))
    metrics = last.metrics if last is not None else RequestMetrics(arrival_time=arrival)
    metrics.finished_time = time.monotonic()
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
                         outputs=outputs, finished=True,
                         num_cached_tokens=last.num_cached_tokens if last is not None else 0,
                         metrics=metrics)

"""The replica deployment: one AsyncEngine per Ray Serve replica, streaming outputs with reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from kvcore.cluster.autoscale import KV_USAGE, NUM_PREEMPTIONS, NUM_WAITING
from kvcore.cluster.engine_view import ReplicaInfo, replica_info
from kvcore.cluster.nodes import check_model_here
from kvcore.cluster.state import ReplicaReport, Route
from kvcore.config import EngineConfig
from kvcore.engine import AsyncEngine
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams


class KVCoreReplica:
    """A Ray Serve deployment class (wrapped by `serve.deployment` in kvcore.cluster.app).

    Every streamed item carries a ReplicaReport: the pool's cache changes since the last item any
    stream of this replica sent (so the ingress sees them every step while requests run) and a
    stats snapshot. Cancelling the caller's stream cancels `generate`, which aborts the request.
    """

    def __init__(self, config: EngineConfig) -> None:
        check_model_here(config.model)  # a clear error naming this node, not a load traceback
        self._engine = AsyncEngine.from_config(config)
        self._engine.enable_cache_events()
        # the id Ray Serve's request router knows this replica by (a restart gets a new one)
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._seq = 0
        self._starting = asyncio.Lock()
        self._started = False

    async def _ready(self) -> AsyncEngine:
        async with self._starting:  # the engine's task must run on the replica's event loop
            if not self._started:
                await self._engine.start()
                self._started = True
        return self._engine

    def _report(self) -> ReplicaReport:
        events = tuple(self._engine.drain_cache_events())
        if events:
            self._seq += 1
        return ReplicaReport(self._replica_id, self._seq, events, self._engine.stats())

    async def info(self) -> tuple[str, ReplicaInfo]:
        return self._replica_id, replica_info(await self._ready())

    async def generate(self, prompt_token_ids: list[int],
                       params: SamplingParams | BeamSearchParams, request_id: str, priority: int,
                       cache_salt: str | None,
                       route: Route) -> AsyncIterator[tuple[RequestOutput, ReplicaReport]]:
        """`route` is read by the request router (kvcore.cluster.router), not here."""
        engine = await self._ready()
        async for output in engine.generate(prompt_token_ids, params, request_id,
                                            priority=priority, cache_salt=cache_salt):
            yield output, self._report()

    async def kv_snapshot(self, *, target_replica: str) -> dict[str, Any] | None:
        """The engine's last published KV snapshot, for the ingress's /debug/kv (polling it keeps
        the engine publishing). `target_replica` is read by the request router, which sends
        the call to that replica alone."""
        assert target_replica == self._replica_id, (target_replica, self._replica_id)
        return await (await self._ready()).kv_snapshot()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The custom metrics kvcore.cluster.autoscale scales on (Ray Serve polls them)."""
        stats = self._engine.stats()
        return {KV_USAGE: stats.kv_cache_usage, NUM_WAITING: float(stats.num_waiting),
                NUM_PREEMPTIONS: float(stats.num_preemptions)}

    async def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine driver died is restarted."""
        if self._started and not self._engine.running:
            raise RuntimeError("the engine driver task ended")

    async def __del__(self) -> None:
        """Graceful shutdown (Ray Serve awaits it): unfinished requests end with "abort"."""
        await self._engine.stop()

"""EngineClient: the engine as the service and the cluster's ingress use it, and nothing more.

AsyncEngine implements it in one process; kvcore.cluster's ClusterEngine over Ray Serve replicas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from kvcore.config import ModelConfig
from kvcore.engine.engine import EngineStats
from kvcore.model.tokenizer import Tokenizer
from kvcore.request import RequestOutput
from kvcore.sampling import BeamSearchParams, SamplingParams
from kvcore.sampling.constraints import Constraint


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def running(self) -> bool: ...

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run (n > 1 and beams count every sequence)."""

    async def prepare(self, constraint: Constraint | None, tenant: str = "default",
                      cache_salt: str | None = None) -> object:
        """Check and compile a constraint before `generate` (ParamError naming the field when
        it is refused), off the event loop, tenants taking turns; hold the result until the
        request ends. The one call for every API's constraints."""

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | BeamSearchParams,
                 request_id: str | None = None, *, priority: int = 0,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it progresses (the last one has finished=True). The
        request's checks against the context run once, here: for token ids a refusal
        (ParamError) raises from this call, before anything is queued."""

    async def abort(self, request_id: str) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def stats(self) -> EngineStats | None:
        """Counters and gauges as last published (None: nothing published yet)."""

    async def kv_snapshot(self, replica_id: str | None = None) -> dict[str, Any] | None:
        """The last published KV inspector snapshot (kvcore.engine.kv_snapshot's format) of
        the engine, or of one replica (ClusterEngine: `replica_ids()` lists them)."""

"""The application's state record, its typed AppKey, and the JSON body reader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvcore.engine import AsyncEngine
from kvcore.service.auth import TenantAuth
from kvcore.service.errors import APIError, bad_request
from kvcore.service.metrics import ServiceMetrics

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"


@dataclass(slots=True)
class ServiceState:
    engine_factory: Callable[[], AsyncEngine] | None  # loads in a worker thread at startup
    auth: TenantAuth
    served_model_names: list[str]
    max_body_size: int  # bytes
    max_waiting: int | None  # 429 once this many requests wait; None: never
    metrics: ServiceMetrics
    created: int  # unix time, /v1/models
    engine: AsyncEngine | None = None
    status: str = LOADING
    load_error: str | None = None
    in_flight: set[asyncio.Task[Any]] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    # the KV inspector: engine request id -> tenant name, and the last /debug/kv body encoded
    tenants: dict[str, str] = field(default_factory=dict)
    inspector_body: tuple[dict[str, Any], bytes] | None = None

    def ready_engine(self) -> AsyncEngine:
        """The engine, or 503 while loading, draining, or after a failed load."""
        if self.status != READY or self.engine is None:
            detail = f": {self.load_error}" if self.load_error else ""
            raise APIError(503, f"the server is {self.status}{detail}",
                           headers={"Retry-After": "1"})
        return self.engine

    def model_name(self, requested: str | None) -> str:
        """The served name a request asked for (the first by default); 404 for any other."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", param="model",
                           code="model_not_found")
        return requested

    def track(self, task: asyncio.Task[Any]) -> None:
        self.in_flight.add(task)
        self.idle.clear()

    def untrack(self, task: asyncio.Task[Any]) -> None:
        self.in_flight.discard(task)
        if not self.in_flight:
            self.idle.set()


STATE_KEY = web.AppKey("kvcore_state", ServiceState)
TENANT_KEY = web.RequestKey("kvcore_tenant", str)  # set by the auth middleware


async def read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past `limit` bytes, 400 when it is not a JSON object.

    Read here rather than with request.json() so the limit holds when the app is mounted as a
    sub-app (aiohttp applies only the root application's client_max_size).
    """
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes is over the limit "
                       f"of {limit} bytes")
    data = bytearray()
    while chunk := await request.content.read(1 << 16):
        data += chunk
        if len(data) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # malformed, bad UTF-8, too deeply nested
        raise bad_request(f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body

"""The application's state record, its typed AppKey, and the JSON body reader."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from kvcore.engine import EngineClient
from kvcore.engine.fair_queue import FairQueue
from kvcore.service.admission import Admission
from kvcore.service.auth import TenantAuth
from kvcore.service.errors import APIError, bad_request
from kvcore.service.generation import Generation
from kvcore.service.metrics import ServiceMetrics

LOADING, READY, DRAINING, FAILED = "loading", "ready", "draining", "failed"
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256  # prompts x n of one call
CPU_WORKERS = 2  # threads for request-sized CPU work (tokenizing, templating, detokenizing)
T = TypeVar("T")


@dataclass(slots=True)
class ServiceState:
    engine_factory: Callable[[], EngineClient] | None  # loads in a worker thread at startup
    auth: TenantAuth
    served_model_names: list[str]
    max_body_size: int  # bytes
    admission: Admission  # --max-waiting: reserves each admitted call's sequences
    metrics: ServiceMetrics
    created: int  # unix time, /v1/models
    engine: EngineClient | None = None
    status: str = LOADING
    load_error: str | None = None
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    body_timeout: float | None = None  # seconds for a request body to arrive; None: no limit
    # in-flight generation calls: their handler task -> the Generation (drain aborts it)
    in_flight: dict[asyncio.Task[Any], Generation] = field(default_factory=dict)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    cpu_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        CPU_WORKERS, thread_name_prefix="kvcore-cpu"))
    cpu_turns: FairQueue = field(default_factory=lambda: FairQueue(CPU_WORKERS))
    # the KV inspector: engine request id -> tenant name, and the last /debug/kv body encoded
    tenants: dict[str, str] = field(default_factory=dict)
    inspector_body: tuple[dict[str, Any], bytes] | None = None

    async def offload(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """Run request-sized CPU work in the bounded worker pool, off the event loop; tenants
        take turns at the workers (kvcore.engine.fair_queue)."""
        await self.cpu_turns.acquire(tenant)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.cpu_pool, fn, *args)
        finally:
            self.cpu_turns.release()

    def check_num_seqs(self, num_seqs: int) -> None:
        """400 when one call asks for more sequences (prompts x n) than a call may run."""
        if num_seqs > self.max_sequences_per_request:
            raise bad_request(f"this call asks for {num_seqs} sequences (prompts x n); at most "
                              f"{self.max_sequences_per_request} per request", "n")
    def ready_engine(self) -> EngineClient:
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

    def track(self, task: asyncio.Task[Any], generation: Generation) -> None:
        self.in_flight[task] = generation
        self.idle.clear()

    def untrack(self, task: asyncio.Task[Any]) -> None:
        self.in_flight.pop(task, None)
        if not self.in_flight:
            self.idle.set()


STATE_KEY = web.AppKey("kvcore_state", ServiceState)
TENANT_KEY = web.RequestKey("kvcore_tenant", str)  # set by the auth middleware


JSON_TYPE = "application/json"


async def read_json(request: web.Request, limit: int,
                    timeout: float | None = None) -> dict[str, Any]:
    """The body as a JSON object: 415 unless it is uncompressed application/json, 413 past
    `limit` bytes, 408 when it does not arrive within `timeout` seconds, 400 when it is not a
    JSON object or holds text that is not valid Unicode (a lone surrogate).

    Read here rather than with request.json() so the limit holds when the app is mounted as a
    sub-app (aiohttp applies only the root application's client_max_size).
    """
    # a browser page can POST text/plain or a form without a CORS preflight: JSON only
    if request.content_type != JSON_TYPE:
        raise APIError(415, f"Content-Type must be {JSON_TYPE}, got "
                       f"{request.content_type or 'none'}", code="unsupported_media_type")
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, "Content-Encoding is not supported; send the body uncompressed",
                       code="unsupported_media_type")
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body of {request.content_length} bytes is over the limit "
                       f"of {limit} bytes")
    data = bytearray()
    try:
        async with asyncio.timeout(timeout):
            while chunk := await request.content.read(1 << 16):
                data += chunk
                if len(data) > limit:
                    raise APIError(413, f"request body is over the limit of {limit} bytes")
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       headers={"Connection": "close"}) from None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:  # malformed, bad UTF-8, too deeply nested
        raise bad_request(f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_text(body)
    return body


def _check_text(body: dict[str, Any]) -> None:
    """400 naming the top-level field whose strings (keys too) are not valid Unicode: JSON
    escapes can spell lone surrogates ("\\ud800") that no tokenizer or encoder accepts."""
    for name, value in body.items():
        stack = [name, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                if not item.isascii():
                    try:
                        item.encode("utf-8")
                    except UnicodeEncodeError:
                        raise bad_request(f"{name} holds text that is not valid Unicode "
                                          "(a lone surrogate)", name) from None
            elif isinstance(item, list):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())

"""The KV inspector: GET /inspector (the page) and GET /debug/kv (its JSON), for admins only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from aiohttp import web

from kvcore.service.errors import APIError, bad_request
from kvcore.service.logtext import log_text
from kvcore.service.state import STATE_KEY, ServiceState

PAGE = Path(__file__).parent / "static" / "inspector.html"  # package data of kvcore.service
# the driver publishes the first snapshot after the step in progress (a long prefill on a CPU)
FIRST_SNAPSHOT_TIMEOUT_S = 30.0
TENANT_GRACE_S = 10.0  # a finished request's tenant stays known to snapshots taken before
REALM = 'Basic realm="kvcore inspector", charset="UTF-8"'  # browsers ask for the key


def _require_admin(request: web.Request) -> None:
    try:
        request.app[STATE_KEY].auth.require_admin(request)
    except APIError as e:
        if e.status == 401:  # a browser then asks for the key (Basic, the key as the password)
            e.headers["WWW-Authenticate"] = REALM
        raise


async def inspector_page(request: web.Request) -> web.Response:
    _require_admin(request)
    return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


@runtime_checkable
class ReplicatedEngine(Protocol):
    """An engine of several replicas (`kvcore serve --replicas`): one KV pool each."""

    def replica_ids(self) -> list[str]: ...

    async def kv_snapshot(self, replica_id: str) -> dict[str, Any] | None: ...


def _snapshot_reader(engine: Any, replica: str | None
                     ) -> tuple[Callable[[], Awaitable[dict[str, Any] | None]], dict[str, Any]]:
    """How to read the snapshot asked for, and what the answer adds: under replicas the
    `replica` shown (the first by default) and the ids to choose from."""
    if isinstance(engine, ReplicatedEngine):
        ids = engine.replica_ids()
        if not ids:
            raise APIError(503, "no replica is up yet", headers={"Retry-After": "1"})
        if replica is None:
            replica = ids[0]
        elif replica not in ids:
            raise bad_request(f"replica must be one of {', '.join(ids)}; got "
                              f"{log_text(replica, 80)}", "replica")
        chosen = replica
        return lambda: engine.kv_snapshot(chosen), {"replica": chosen, "replicas": ids}
    if replica is not None:
        raise bad_request("this server runs one engine: there is no replica to choose",
                          "replica")

    return engine.kv_snapshot, {}


async def debug_kv(request: web.Request) -> web.Response:
    """The engine's last published KV snapshot (kvcore.engine.kv_snapshot's format) with the
    tenant of each request group; under replicas, one replica's (`?replica=ID`). The encoded
    body is reused while the snapshot is the same."""
    _require_admin(request)
    state = request.app[STATE_KEY]
    read, extra = _snapshot_reader(state.ready_engine(), request.query.get("replica"))
    snapshot = await read()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FIRST_SNAPSHOT_TIMEOUT_S
    while snapshot is None:  # nobody polled before: the driver publishes within a tick
        if loop.time() > deadline:
            raise APIError(503, "the engine has not published a KV snapshot yet",
                           headers={"Retry-After": "1"})
        await asyncio.sleep(0.02)
        snapshot = await read()
    cached = state.inspector_body
    if cached is None or cached[0] is not snapshot:
        tenants = {r["group"]: state.tenants.get(r["group"]) for r in snapshot["requests"]}
        body: dict[str, Any] = {**snapshot, "tenants": tenants, **extra}
        cached = (snapshot, json.dumps(body, separators=(",", ":")).encode())
        state.inspector_body = cached
    return web.Response(body=cached[1], content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def forget_tenants(state: ServiceState, request_ids: list[str]) -> None:
    """Drop finished requests' tenants after a grace period: a snapshot published just before
    they finished may still be served."""
    def forget() -> None:
        for request_id in request_ids:
            state.tenants.pop(request_id, None)
    asyncio.get_running_loop().call_later(TENANT_GRACE_S, forget)


ADMIN_HANDLERS = frozenset({inspector_page, debug_kv})  # their own auth (Basic accepted)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/inspector", inspector_page)
    app.router.add_get("/debug/kv", debug_kv)

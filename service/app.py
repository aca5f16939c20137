"""make_app(): the aiohttp application (mountable as a sub-app), its middlewares and lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvcore.engine import AsyncEngine, EngineClient
from kvcore.service import inspector, messages_routes, responses_routes, routes
from kvcore.service.admission import Admission
from kvcore.service.auth import TenantAuth, keys_from_list
from kvcore.service.errors import APIError
from kvcore.service.logtext import log_text
from kvcore.service.metrics import ServiceMetrics
from kvcore.service.openai_routes import chat_completions, completions
from kvcore.service.state import (
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DRAINING,
    FAILED,
    LOADING,
    READY,
    STATE_KEY,
    TENANT_KEY,
    ServiceState,
)

log = structlog.get_logger("kvcore.service")

DEFAULT_MAX_BODY_SIZE = 4 << 20  # bytes; a request body past it is a 413
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body must arrive within this (408)
ABORT_GRACE_S = 5.0  # after a drain's aborts, how long streams get to write their last chunk


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in the OpenAI shape (Anthropic's under /v1/messages); an unexpected
    exception is a logged 500."""
    anthropic = request.path.startswith("/v1/messages")
    try:
        return await handler(request)
    except APIError as e:
        return e.response(anthropic)
    except web.HTTPException as e:  # aiohttp's own: 404 unknown route, 405 wrong method
        if e.status < 400:
            raise
        headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
        return APIError(e.status, e.reason, headers=headers).response(anthropic)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        log.exception("unhandled error", path=log_text(request.path))
        return APIError(500, "internal server error").response(anthropic)


def _auth_middleware(auth: TenantAuth) -> Middleware:
    own_auth = routes.PUBLIC_HANDLERS | inspector.ADMIN_HANDLERS

    @web.middleware
    async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.handler not in own_auth:
            request[TENANT_KEY] = auth.tenant_for(request)
        return await handler(request)
    return _auth


async def _load(state: ServiceState) -> None:
    assert state.engine_factory is not None
    try:
        # building an engine reads weights: a worker thread keeps /health answering meanwhile
        engine = await asyncio.to_thread(state.engine_factory)
        await engine.start()
    except Exception as e:
        state.status, state.load_error = FAILED, f"{type(e).__name__}: {e}"
        log.error("engine load failed", error=state.load_error)
        return
    state.engine = engine
    state.tools()  # the tool format, chosen once per tokenizer
    if state.status == LOADING:
        state.status = READY


async def _engine_lifetime(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: start (or load) the engine; at cleanup abort what is left and stop it."""
    state = app[STATE_KEY]
    loader = None
    if state.engine is not None:
        await state.engine.start()
        state.tools()
        state.status = READY
    else:
        loader = asyncio.create_task(_load(state))
    yield
    state.status = DRAINING
    if loader is not None:
        await loader
    await drain(app, timeout=0.0)
    if state.engine is not None:
        await state.engine.stop()
    state.cpu_pool.shutdown(wait=False, cancel_futures=True)


async def drain(app: web.Application, timeout: float) -> int:
    """Stop admitting (503), let in-flight requests finish for up to `timeout` seconds, then
    abort the rest: their streams end well-formed (finish_reason "abort", then [DONE]). Handlers
    still running a moment later are cancelled. Returns how many calls were aborted."""
    state = app[STATE_KEY]
    if state.status in (READY, LOADING):
        state.status = DRAINING
    if state.in_flight and timeout > 0:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), timeout)
    left = list(state.in_flight.items())
    for _, call in left:
        await call.abort()
    if left:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state.idle.wait(), ABORT_GRACE_S)
    for task in list(state.in_flight):
        task.cancel()
    if state.in_flight:
        await asyncio.gather(*state.in_flight, return_exceptions=True)
    return len(left)


def make_app(engine: EngineClient | Callable[[], EngineClient], *,
             api_keys: Mapping[str, str] | Iterable[str] | None = None,
             served_model_name: str | Sequence[str] | None = None,
             max_body_size: int = DEFAULT_MAX_BODY_SIZE, max_waiting: int | None = None,
             cache_salt_secret: bytes | None = None,
             max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
             body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S,
             admin_keys: Iterable[str] = ()) -> web.Application:
    """The OpenAI-compatible application around an EngineClient (AsyncEngine, or the cluster's
    ClusterEngine).

    `engine` is a ready EngineClient, or a callable that builds one (it runs in a worker thread at
    startup while /health answers 503). `api_keys`: keys (each its own tenant) or a mapping
    key -> tenant; None or empty: no auth, one tenant. `admin_keys`: keys that may also open the
    KV inspector (/inspector, /debug/kv; open to all without keys); one not among `api_keys` is
    added as tenant `admin<i>`. The app's cleanup_ctx starts the engine and
    stops it at cleanup, so mount it (`root.add_subapp("/llm", app)`) or run it as is.
    `max_waiting` counts sequences (n > 1 and batched prompts count each); a call is admitted
    whole or answered 429. `max_sequences_per_request` bounds prompts x n of one call (400);
    `body_timeout`: seconds for a request body to arrive (408), None for no limit.
    """
    if max_body_size <= 0:
        raise ValueError(f"max_body_size must be > 0, got {max_body_size}")
    if max_sequences_per_request < 1:
        raise ValueError(f"max_sequences_per_request must be >= 1, "
                         f"got {max_sequences_per_request}")
    if body_timeout is not None and body_timeout <= 0:
        raise ValueError(f"body_timeout must be > 0, got {body_timeout}")
    keys = (dict(api_keys) if isinstance(api_keys, Mapping)
            else keys_from_list(api_keys) if api_keys is not None else {})
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    elif isinstance(engine, AsyncEngine):
        names = [Path(engine.config.model).name]
    else:
        raise ValueError("served_model_name is required when the engine is built lazily")
    admins = list(admin_keys)
    for i, key in enumerate(admins):
        if not key:
            raise ValueError("admin keys must be non-empty")
        keys.setdefault(key, f"admin{i}")
    auth = TenantAuth(keys, cache_salt_secret, admins)
    state = ServiceState(
        engine_factory=engine if callable(engine) else None,
        auth=auth, served_model_names=names, max_body_size=max_body_size,
        admission=Admission(max_waiting), metrics=None,  # type: ignore[arg-type]
        created=int(time.time()), engine=None if callable(engine) else engine,
        max_sequences_per_request=max_sequences_per_request, body_timeout=body_timeout)
    state.metrics = ServiceMetrics(
        names[0], lambda: state.engine.stats() if state.engine is not None else None)
    state.idle.set()
    app = web.Application(middlewares=[_errors, _auth_middleware(auth)])
    app[STATE_KEY] = state
    app.cleanup_ctx.append(_engine_lifetime)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages_routes.create_message)
    app.router.add_post("/v1/messages/count_tokens", messages_routes.count_tokens)
    app.router.add_post("/v1/responses", responses_routes.create_response)
    app.router.add_get("/v1/responses/{id}", responses_routes.get_response)
    app.router.add_delete("/v1/responses/{id}", responses_routes.delete_response)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/openapi.json", routes.openapi)
    inspector.add_routes(app)
    return app

"""POST /v1/completions and /v1/chat/completions: JSON, SSE, or msgpack frames.

Body -> Call (service.protocol) -> tokenized -> `respond`: the engine requests run, their
deltas become the wire format's chunks or its whole answer (service.formatter). Another
protocol reuses `respond` with its own parser and format."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import structlog
from aiohttp import web

from kvcore.engine import RequestFailed
from kvcore.model.tokenizer import Tokenizer
from kvcore.request import RequestMetrics
from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.call import Call
from kvcore.service.errors import APIError
from kvcore.service.formatter import MsgpackFrames, OpenAIFormat, WireFormat
from kvcore.service.inspector import forget_tenants
from kvcore.service.logtext import log_text
from kvcore.service.protocol import check_prompt_chars, parse_chat, parse_completion
from kvcore.service.schema_check import answer_violations, needs_check
from kvcore.service.state import STATE_KEY, TENANT_KEY, ServiceState, read_json
from kvcore.service.streaming import MSGPACK_TYPE
from kvcore.service.structured import prepare_constraint
from kvcore.service.tool_format import chat_text
from kvcore.service.tools import structured_kind

log = structlog.get_logger("kvcore.service")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    with refusals_logged(tenant, kind):
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        if kind == "chat":
            call = parse_chat(body, engine.model_config.vocab_size, state.tools())
        else:
            call = parse_completion(body, engine.model_config.vocab_size)
        name = await tokenized(state, tenant, call,
                               "chatcmpl" if kind == "chat" else "cmpl")
    binary = MSGPACK_TYPE in request.headers.get("Accept", "")
    fmt: WireFormat = (MsgpackFrames(call) if binary
                       else OpenAIFormat(call, name, engine.tokenizer))
    return await respond(request, state, call, fmt, tenant)


@contextlib.contextmanager
def refusals_logged(tenant: str, endpoint: str) -> Iterator[None]:
    """The log line of a call refused before the engine: an admitted call's fields, no body."""
    try:
        yield
    except APIError as e:
        log.info("request", request_id=None, tenant=tenant, endpoint=endpoint,
                 outcome=f"error {e.status}", prompt_tokens=0, completion_tokens=0,
                 cached_tokens=0, ttft_s=None, finish_reason=[], user=None)
        raise


async def tokenized(state: ServiceState, tenant: str, call: Call, id_prefix: str,
                    messages_param: str = "messages") -> str:
    """Check a parsed Call's size, name it and tokenize it (off the event loop); returns the
    served model name it asked for (404 for another)."""
    engine = state.ready_engine()
    name = state.model_name(call.model)
    state.check_num_seqs(call.num_seqs)
    texts: list[str | list[int]] = (["".join(m["content"] for m in call.messages)]
                                    if call.kind == "chat" else list(call.prompts))
    for text in texts:
        check_prompt_chars(text, engine.max_model_len, engine.tokenizer.max_token_chars,
                           messages_param if call.kind == "chat" else "prompt")
    call.call_id = f"{id_prefix}-{uuid.uuid4().hex}"
    # tokenizing (and templating) is request-sized CPU work: off the event loop
    call.prompt_ids = await state.offload(tenant, _tokenize, call, engine.tokenizer)
    return name


def _tokenize(call: Call, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt (an empty one is the engine's 400)."""
    if call.kind == "completion":
        return [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p
                for p in call.prompts]
    return [tokenizer.encode(chat_text(call, tokenizer, call.tool_format),
                             add_special_tokens=False)]


async def respond(request: web.Request, state: ServiceState, call: Call, fmt: WireFormat,
                  tenant: str) -> web.StreamResponse:
    """Run a tokenized Call and answer it in `fmt`'s wire format (a format of
    service.formatter): streamed when the call or the format asks for it, else whole."""
    engine = state.ready_engine()
    task = asyncio.current_task()
    assert task is not None
    outcome = "ok"
    tracked = False
    prepared: object = None
    try:
        # the engine checks each prompt first: a call that can never run is bad input (400),
        # not a busy server; its constraint compiled first, off the event loop (the result
        # held until the call ends keeps the compiled grammar for the engine)
        salt = state.auth.cache_salt(tenant, call.cache_salt)
        prepared = await prepare_constraint(engine, call.params.constraint, tenant, salt)
        call.submit(engine, salt)
        # reserved before any await: calls that arrive together each see the others' sequences
        reservation = state.admission.admit(engine, call.num_seqs)
        state.track(task, call)
        tracked = True
        kind = structured_kind(call)
        if kind is not None:
            state.metrics.observe_structured(kind)
            call.keep_texts = needs_check(call)
        for request_id in call.request_ids:  # the KV inspector names each request's tenant
            state.tenants[request_id] = tenant
        # a client that goes away cancels this handler (aiohttp's handler_cancellation, which
        # `kvcore serve` and aiohttp's test server turn on): the finally below aborts
        call.start(reservation, state.metrics.observe_token_gap)
        if not (call.stream or fmt.streams_only):
            async for _ in call.deltas():
                pass
            return web.json_response(fmt.final(), headers={"X-Request-Id": call.call_id})
        response, outcome = await _stream(request, call, fmt)
        return response
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except APIError as e:
        outcome = f"error {e.status}"
        raise
    except Exception as e:
        outcome = f"error 500 {type(e).__name__}"
        raise
    finally:
        del prepared  # the call's hold on its compiled constraint ends with it
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(call.close())
        if tracked:
            state.untrack(task)
        forget_tenants(state, call.request_ids)
        _account(state, call, tenant, outcome)
        if call.keep_texts and outcome == "ok":
            _check_answers(state, call)


async def _stream(request: web.Request, call: Call, fmt: WireFormat
                  ) -> tuple[web.StreamResponse, str]:
    """Stream the call; returns the response and its outcome. After the headers every failure
    travels in the stream (one error event, then the stream's normal end), never as a second
    HTTP response."""
    outputs = call.deltas()
    # the first output comes before the headers, so a request the engine refuses is still a 400
    first = await anext(outputs, None)
    response = web.StreamResponse(headers={
        "Content-Type": fmt.content_type, "Cache-Control": "no-cache",
        "X-Request-Id": call.call_id})
    await response.prepare(request)
    outcome = "ok"
    try:
        data = fmt.open()
        deltas = first
        while deltas is not None:
            data += b"".join(fmt.chunk(delta) for delta in deltas)
            if data:
                await response.write(data)
            data = b""
            deltas = await anext(outputs, None)
        await response.write(fmt.close())
    except ConnectionError:  # the client went away mid-write: close() aborts the requests
        return response, "disconnected"
    except Exception as e:
        # after the headers an error can only travel in the stream
        error = e if isinstance(e, APIError) else APIError(500, "generation failed: "
                                                           f"{type(e).__name__}: {e}")
        if not isinstance(e, APIError | RequestFailed):
            log.exception("stream failed", request_id=call.call_id)
        outcome = f"error {error.status}"
        with contextlib.suppress(ConnectionError):
            await response.write(fmt.error(error))
    finally:
        await outputs.aclose()
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response, outcome


def _check_answers(state: ServiceState, call: Call) -> None:
    """The schema keywords decoding could not enforce, checked on the finished answers."""
    for index, texts in call.texts.items():
        broken = answer_violations(call, "".join(texts))
        if broken:
            state.metrics.unenforced.labels(state.metrics.model_name).inc()
            log.warning("unenforced schema keyword broken", request_id=call.call_id,
                        choice=index, where=broken[:8])


def _account(state: ServiceState, call: Call, tenant: str, outcome: str) -> None:
    """Metrics and the one log line of a call."""
    ttfts = []
    n = call.n
    for i, last in enumerate(call.last):
        # a call cancelled before any output (disconnect, drain) still aborted its request
        started = last is not None or outcome == "cancelled"
        reasons = [call.finish_reasons.get(i * n + k, "abort") for k in range(n)]
        timings = last.metrics if last is not None else None
        state.metrics.observe_request(len(call.prompt_ids[i]) if last else 0,
                                      call.num_generated[i], reasons if started else [],
                                      timings)
        if timings is not None and timings.first_token_time is not None:
            ttfts.append(timings.first_token_time - timings.arrival_time)
    usage = call.usage()
    finals = [last.metrics for last in call.last if last is not None]
    drafted = sum(m.num_draft_tokens for m in finals)
    log.info("request", request_id=call.call_id, tenant=tenant, endpoint=call.kind,
             outcome=outcome, prompt_tokens=usage["prompt_tokens"],
             completion_tokens=usage["completion_tokens"],
             cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
             ttft_s=round(min(ttfts), 6) if ttfts else None,
             finish_reason=[call.finish_reasons.get(i) for i in range(len(call.last) * n)],
             user=log_text(call.user),
             spec_acceptance=round(sum(m.num_accepted_tokens for m in finals) / drafted, 4)
             if drafted else None, restored_tokens=_restored(finals))


def _restored(finals: list[RequestMetrics]) -> dict[str, int] | None:
    """Prompt tokens the call's requests restored from each KV tier (None: none)."""
    out: dict[str, int] = {}
    for metrics in finals:
        for tier, num in (metrics.restored_tokens or {}).items():
            out[tier] = out.get(tier, 0) + num
    return out or None

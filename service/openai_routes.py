"""POST /v1/completions and /v1/chat/completions: JSON, SSE, or msgpack frames.

Body -> Call (service.protocol) -> engine requests (service.generation) -> engine outputs ->
chunks and the final response (service.formatter)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import structlog
from aiohttp import web

from kvcore.engine import RequestFailed
from kvcore.model.tokenizer import Tokenizer
from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.errors import APIError
from kvcore.service.formatter import Formatter
from kvcore.service.generation import Generation, Job
from kvcore.service.inspector import forget_tenants
from kvcore.service.logtext import log_text
from kvcore.service.protocol import Call, check_prompt_chars, parse_chat, parse_completion
from kvcore.service.state import STATE_KEY, TENANT_KEY, ServiceState, read_json
from kvcore.service.streaming import MSGPACK_TYPE, SSE_DONE, msgpack_frame, sse_event
from kvcore.service.structured import prepare_constraint
from kvcore.service.tool_format import chat_text, with_format
from kvcore.service.tools import structured_kind

log = structlog.get_logger("kvcore.service")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    try:
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        tokenizer, max_model_len = engine.tokenizer, engine.max_model_len
        if kind == "chat":
            call = with_format(parse_chat(body, engine.model_config.vocab_size), tokenizer)
            texts: list[str | list[int]] = ["".join(m["content"] for m in call.messages)]
        else:
            call = parse_completion(body, engine.model_config.vocab_size)
            texts = list(call.prompts)
        name = state.model_name(call.model)
        state.check_num_seqs(max(len(call.prompts), 1) * call.n)
        for text in texts:
            check_prompt_chars(text, max_model_len, tokenizer.max_token_chars,
                               "messages" if kind == "chat" else "prompt")
        call_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # tokenizing (and templating) is request-sized CPU work: off the event loop
        prompts = await state.offload(tenant, _tokenize, call, tokenizer)
    except APIError as e:
        # the log line of a call refused before the engine: an admitted call's fields, no body
        log.info("request", request_id=None, tenant=tenant, endpoint=kind,
                 outcome=f"error {e.status}", prompt_tokens=0, completion_tokens=0,
                 cached_tokens=0, ttft_s=None, finish_reason=[], user=None)
        raise
    jobs = [Job(i, f"{call_id}-{i}", ids, call.params_for(len(ids), max_model_len))
            for i, ids in enumerate(prompts)]
    return await _respond(request, state, call, jobs, call_id, name, tenant)


def _tokenize(call: Call, tokenizer: Tokenizer) -> list[list[int]]:
    """The token ids of each prompt (an empty one is the engine's 400)."""
    if call.kind == "completion":
        return [tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p
                for p in call.prompts]
    return [tokenizer.encode(chat_text(call, tokenizer), add_special_tokens=False)]


async def _respond(request: web.Request, state: ServiceState, call: Call, jobs: list[Job],
                   call_id: str, model: str, tenant: str) -> web.StreamResponse:
    engine = state.ready_engine()
    gen = Generation(engine, jobs, call.n, state.metrics.observe_token_gap)
    fmt = Formatter(call, gen, call_id, model, engine.tokenizer)
    binary = MSGPACK_TYPE in request.headers.get("Accept", "")
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
        gen.check(call.priority, salt)
        # reserved before any await: calls that arrive together each see the others' sequences
        reservation = state.admission.admit(engine, len(jobs) * call.n)
        state.track(task, gen)
        tracked = True
        kind = structured_kind(call)
        if kind is not None:
            state.metrics.observe_structured(kind)
        for job in jobs:  # the KV inspector names each request's tenant
            state.tenants[job.request_id] = tenant
        # a client that goes away cancels this handler (aiohttp's handler_cancellation, which
        # `kvcore serve` and aiohttp's test server turn on): the finally below aborts
        gen.start(reservation)
        if not (call.stream or binary):
            async for job, output in gen.outputs():
                for _ in fmt.deltas(job, output):
                    pass
            return web.json_response(fmt.final(), headers={"X-Request-Id": call_id})
        response, outcome = await _stream(request, call, gen, fmt, binary)
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
            await asyncio.shield(gen.close())
        if tracked:
            state.untrack(task)
        forget_tenants(state, [job.request_id for job in jobs])
        _account(state, gen, fmt, tenant, outcome)


async def _stream(request: web.Request, call: Call, gen: Generation, fmt: Formatter,
                  binary: bool) -> tuple[web.StreamResponse, str]:
    """Stream the call; returns the response and its outcome. After the headers every failure
    travels in the stream (one error event, then the stream's normal end), never as a second
    HTTP response."""
    outputs = gen.outputs()
    # the first output comes before the headers, so a request the engine refuses is still a 400
    first = await anext(outputs, None)
    response = web.StreamResponse(headers={
        "Content-Type": MSGPACK_TYPE if binary else "text/event-stream",
        "Cache-Control": "no-cache", "X-Request-Id": fmt.call_id})
    await response.prepare(request)
    outcome = "ok"
    try:
        if fmt.chat and not binary:
            await response.write(fmt.role_chunks())
        item = first
        while item is not None:
            data = b"".join(fmt.chunk(delta, binary) for delta in fmt.deltas(*item))
            if data:
                await response.write(data)
            item = await anext(outputs, None)
        if not binary:
            await response.write((fmt.usage_chunk() if call.include_usage else b"") + SSE_DONE)
    except ConnectionError:  # the client went away mid-write: close() aborts the requests
        return response, "disconnected"
    except Exception as e:
        # after the headers an error can only travel in the stream
        error = e if isinstance(e, APIError) else APIError(500, "generation failed: "
                                                           f"{type(e).__name__}: {e}")
        if not isinstance(e, APIError | RequestFailed):
            log.exception("stream failed", request_id=fmt.call_id)
        outcome = f"error {error.status}"
        with contextlib.suppress(ConnectionError):
            await response.write(msgpack_frame(error.body()) if binary
                                 else sse_event(error.body()) + SSE_DONE)
    finally:
        await outputs.aclose()
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response, outcome


def _account(state: ServiceState, gen: Generation, fmt: Formatter, tenant: str,
             outcome: str) -> None:
    """Metrics and the one log line of a call."""
    ttfts = []
    n = fmt.n
    for job in gen.jobs:
        last = job.last_output
        # a call cancelled before any output (disconnect, drain) still aborted its request
        started = last is not None or outcome == "cancelled"
        reasons = [fmt.finish_reasons.get(job.index * n + i, "abort") for i in range(n)]
        timings = last.metrics if last is not None else None
        state.metrics.observe_request(len(job.prompt_token_ids) if last else 0,
                                      job.num_generated, reasons if started else [], timings)
        if timings is not None and timings.first_token_time is not None:
            ttfts.append(timings.first_token_time - timings.arrival_time)
    usage = gen.usage()
    finals = [job.last_output.metrics for job in gen.jobs if job.last_output is not None]
    drafted = sum(m.num_draft_tokens for m in finals)
    log.info("request", request_id=fmt.call_id, tenant=tenant, endpoint=fmt.call.kind,
             outcome=outcome, prompt_tokens=usage["prompt_tokens"],
             completion_tokens=usage["completion_tokens"],
             cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
             ttft_s=round(min(ttfts), 6) if ttfts else None,
             finish_reason=[fmt.finish_reasons.get(i) for i in range(len(gen.jobs) * n)],
             user=log_text(fmt.call.user),
             spec_acceptance=round(sum(m.num_accepted_tokens for m in finals) / drafted, 4)
             if drafted else None)

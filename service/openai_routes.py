"""POST /v1/completions and /v1/chat/completions: JSON, SSE, or msgpack frames."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import structlog
from aiohttp import web

from kvcore.config import ParamError
from kvcore.engine import RequestFailed
from kvcore.model.tokenizer import Tokenizer
from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.errors import APIError, bad_request
from kvcore.service.generation import (
    Delta,
    Generation,
    Job,
    build_params,
)
from kvcore.service.inspector import forget_tenants
from kvcore.service.logtext import log_text
from kvcore.service.protocol import (
    GenerationRequest,
    check_prompt_chars,
    parse_chat,
    parse_completion,
)
from kvcore.service.state import STATE_KEY, TENANT_KEY, ServiceState, read_json
from kvcore.service.streaming import (
    MSGPACK_TYPE,
    SSE_DONE,
    LogprobFormatter,
    msgpack_frame,
    sse_event,
)
from kvcore.service.tool_format import FORMATS, tool_format, with_format
from kvcore.service.tools import structured_kind

log = structlog.get_logger("kvcore.service")


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        req = parse_completion(body, engine.model_config.vocab_size)
        name = state.model_name(req.model)
        state.check_num_seqs(len(req.prompts) * req.n)
        call_id = f"cmpl-{uuid.uuid4().hex}"
        for prompt in req.prompts:
            check_prompt_chars(prompt, engine.max_model_len, engine.tokenizer.max_token_chars,
                               "prompt")
        # tokenizing is request-sized CPU work: off the event loop
        jobs = await state.offload(request.get(TENANT_KEY, ANONYMOUS_TENANT), _completion_jobs,
                                   req, engine.tokenizer, engine.max_model_len, call_id)
    except APIError as e:
        _log_refused(request, "completion", e)
        raise
    return await _respond(request, state, req, jobs, call_id, name)


def _log_refused(request: web.Request, endpoint: str, error: APIError) -> None:
    """The request log line of a call refused before it reached the engine (bad input, a
    busy or loading server): the same fields as an admitted call's, nothing of the body."""
    log.info("request", request_id=None, tenant=request.get(TENANT_KEY, ANONYMOUS_TENANT),
             endpoint=endpoint, outcome=f"error {error.status}", prompt_tokens=0,
             completion_tokens=0, cached_tokens=0, ttft_s=None, finish_reason=[], user=None)


def _completion_jobs(req: GenerationRequest, tokenizer: Tokenizer, max_model_len: int,
                     call_id: str) -> list[Job]:
    jobs = []
    for i, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt, add_special_tokens=True)
            text = prompt
        else:
            ids, text = prompt, tokenizer.decode(prompt, skip_special_tokens=False)
        if not ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
        params = build_params(req, max_model_len - len(ids))
        jobs.append(Job(i, f"{call_id}-{i}", ids, text, params))
    return jobs


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    try:
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        req = with_format(parse_chat(body, engine.model_config.vocab_size), engine.tokenizer)
        name = state.model_name(req.model)
        state.check_num_seqs(req.n)
        check_prompt_chars("".join(m["content"] for m in req.messages), engine.max_model_len,
                           engine.tokenizer.max_token_chars, "messages")
        call_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = await state.offload(request.get(TENANT_KEY, ANONYMOUS_TENANT), _chat_job, req,
                                  engine.tokenizer, engine.max_model_len, call_id)
    except APIError as e:
        _log_refused(request, "chat", e)
        raise
    return await _respond(request, state, req, [job], call_id, name)


def _chat_job(req: GenerationRequest, tokenizer: Tokenizer, max_model_len: int,
              call_id: str) -> Job:
    messages, tools = tool_format(tokenizer.chat_template).render(req.messages, req.tools)
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=req.add_generation_prompt,
                                             tools=tools)
    except ValueError as e:  # the template refused the conversation (roles, order)
        raise bad_request(f"chat template: {e}", "messages") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("messages encode to no tokens", "messages")
    return Job(0, f"{call_id}-0", ids, text, build_params(req, max_model_len - len(ids)))


class _Formatter:
    """Builds the OpenAI objects of one call: stream chunks and the final response."""

    def __init__(self, req: GenerationRequest, gen: Generation, call_id: str, model: str,
                 logprobs: LogprobFormatter) -> None:
        self.req, self.gen, self.call_id, self.model = req, gen, call_id, model
        self.created = int(time.time())
        self.lp = logprobs
        chat = req.kind == "chat"
        self.object = "chat.completion" if chat else "text_completion"
        last = req.messages[-1] if chat and req.messages else None
        # chat echo (vLLM): the reply starts with the last message when it is the assistant's
        self.chat_echo = last["content"] if (req.echo and last and last["role"] == "assistant"
                                             ) else ""
        # tool calls: each choice's text goes through a parser (content vs delta.tool_calls)
        self.tool_streams = ({c.index: FORMATS[req.tools.format].stream() for c in gen.choices}
                             if req.tools is not None else None)

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        suffix = ".chunk" if chunk and self.req.kind == "chat" else ""
        return {"id": self.call_id, "object": self.object + suffix, "created": self.created,
                "model": self.model, "choices": choices}

    def _echo(self, index: int) -> str:
        if not self.req.echo:
            return ""
        if self.req.kind == "chat":
            return self.chat_echo
        return self.gen.jobs[index // self.req.n].prompt_text

    def _completion_logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        out, delta.choice.text_offset = self.lp.completion(delta.logprobs, delta.choice.text_offset)
        return out

    def role_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open every choice with its role (vLLM and OpenAI do)."""
        chunks = []
        for choice in self.gen.choices:
            choice.started = True
            delta = {"role": "assistant", "content": self._echo(choice.index)}
            chunks.append(self._envelope([{"index": choice.index, "delta": delta,
                                           "logprobs": None, "finish_reason": None}], True))
        return chunks

    def chunk(self, delta: Delta) -> dict[str, Any]:
        choice = delta.choice
        text = delta.text
        if not choice.started:
            choice.started = True
            text = self._echo(choice.index) + text
        entry: dict[str, Any] = {"index": choice.index}
        finish_reason = delta.finish_reason
        if self.tool_streams is not None:
            stream = self.tool_streams[choice.index]
            text, calls = stream.feed(text, finish_reason is not None)
            entry["delta"] = {"content": text} if text else {}
            if calls:
                entry["delta"]["tool_calls"] = calls
            if finish_reason == "stop" and stream.num_calls:
                finish_reason = "tool_calls"
            entry["logprobs"] = (self.lp.chat(delta.logprobs) if self.req.logprobs is not None
                                 else None)
        elif self.req.kind == "chat":
            entry["delta"] = {"content": text} if text or delta.finish_reason is None else {}
            entry["logprobs"] = (self.lp.chat(delta.logprobs) if self.req.logprobs is not None
                                 else None)
        else:
            entry["text"] = text
            entry["logprobs"] = self._completion_logprobs(delta)
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = choice.stop_reason if delta.finish_reason else None
        return self._envelope([entry], True)

    def usage_chunk(self) -> dict[str, Any]:
        return self._envelope([], True) | {"usage": self.gen.usage()}

    def final(self) -> dict[str, Any]:
        choices = []
        for choice in self.gen.choices:
            text = self._echo(choice.index) + choice.text
            entry: dict[str, Any] = {"index": choice.index}
            finish_reason = choice.finish_reason
            if self.req.kind == "chat":
                entry["message"] = {"role": "assistant", "content": text}
                if self.req.tools is not None:
                    content, calls = FORMATS[self.req.tools.format].parse(text)
                    entry["message"] = {"role": "assistant", "content": content}
                    if calls:
                        entry["message"]["tool_calls"] = calls
                        finish_reason = ("tool_calls" if finish_reason == "stop"
                                         else finish_reason)
                entry["logprobs"] = (self.lp.chat(choice.logprobs) if self.req.logprobs is not None
                                     else None)
            else:
                entry["text"] = text
                entry["logprobs"] = (self.lp.completion(choice.logprobs, 0)[0]
                                     if self.req.logprobs is not None else None)
            entry["finish_reason"] = finish_reason
            entry["stop_reason"] = choice.stop_reason
            choices.append(entry)
        return self._envelope(choices, False) | {"usage": self.gen.usage()}


async def _respond(request: web.Request, state: ServiceState, req: GenerationRequest,
                   jobs: list[Job], call_id: str, model: str) -> web.StreamResponse:
    async_engine = state.ready_engine()
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    gen = Generation(async_engine, req, jobs, state.auth.cache_salt(tenant, req.cache_salt),
                     state.metrics.observe_token_gap)
    fmt = _Formatter(req, gen, call_id, model, LogprobFormatter(async_engine.tokenizer))
    binary = MSGPACK_TYPE in request.headers.get("Accept", "")
    task = asyncio.current_task()
    assert task is not None
    outcome = "ok"
    tracked = False
    try:
        for job in jobs:  # a call that can never run is bad input (400), not a busy server
            try:
                async_engine.check_request(job.prompt_token_ids, job.params)
            except ParamError as e:
                raise bad_request(str(e), e.param) from None
        # reserved before any await: calls that arrive together each see the others' sequences
        reservation = state.admission.admit(async_engine, len(jobs) * req.n)
        state.track(task, gen)
        tracked = True
        kind = structured_kind(req)
        if kind is not None:
            state.metrics.observe_structured(kind)
        for job in jobs:  # the KV inspector names each request's tenant
            state.tenants[job.request_id] = tenant
        # a client that goes away cancels this handler (aiohttp's handler_cancellation, which
        # `kvcore serve` and aiohttp's test server turn on): the finally below aborts
        gen.start(reservation)
        if not (req.stream or binary):
            async for _ in gen.deltas():
                pass
            return web.json_response(fmt.final(), headers={"X-Request-Id": call_id})
        response, outcome = await _stream(request, req, gen, fmt, binary)
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
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(gen.close())
        if tracked:
            state.untrack(task)
        forget_tenants(state, [job.request_id for job in jobs])
        _account(state, gen, call_id, tenant, req, outcome)


async def _stream(request: web.Request, req: GenerationRequest, gen: Generation, fmt: _Formatter,
                  binary: bool) -> tuple[web.StreamResponse, str]:
    """Stream the call; returns the response and its outcome. After the headers every failure
    travels in the stream (one error event, then the stream's normal end), never as a second
    HTTP response."""
    stream = gen.deltas()
    # the first output comes before the headers, so a request the engine refuses is still a 400
    first = await anext(stream, None)
    content_type = MSGPACK_TYPE if binary else "text/event-stream"
    response = web.StreamResponse(headers={"Content-Type": content_type,
                                           "Cache-Control": "no-cache",
                                           "X-Request-Id": fmt.call_id})
    await response.prepare(request)

    def encode(delta: Delta) -> bytes:
        if binary:
            return msgpack_frame({"index": delta.choice.index, "token_ids": delta.token_ids,
                                  "text": delta.text, "finish_reason": delta.finish_reason})
        return sse_event(fmt.chunk(delta))

    outcome = "ok"
    try:
        if req.kind == "chat" and not binary:
            await response.write(b"".join(sse_event(c) for c in fmt.role_chunks()))
        batch = first
        while batch is not None:
            await response.write(b"".join(encode(d) for d in batch))
            batch = await anext(stream, None)
        if not binary:
            tail = sse_event(fmt.usage_chunk()) if req.include_usage else b""
            await response.write(tail + SSE_DONE)
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
        await stream.aclose()
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response, outcome


def _account(state: ServiceState, gen: Generation, call_id: str, tenant: str,
             req: GenerationRequest, outcome: str) -> None:
    """Metrics and the one log line of a call."""
    ttfts = []
    for job in gen.jobs:
        choices = gen.choices[job.index * req.n:(job.index + 1) * req.n]
        # a call cancelled before any output (disconnect, drain) still aborted its request
        started = job.last_output is not None or outcome == "cancelled"
        reasons = [c.finish_reason or "abort" for c in choices] if started else []
        timings = job.last_output.metrics if job.last_output else None
        state.metrics.observe_request(len(job.prompt_token_ids) if job.last_output else 0,
                                      sum(len(c.token_ids) for c in choices), reasons, timings)
        if timings is not None and timings.first_token_time is not None:
            ttfts.append(timings.first_token_time - timings.arrival_time)
    usage = gen.usage()
    finals = [job.last_output.metrics for job in gen.jobs if job.last_output is not None]
    drafted = sum(m.num_draft_tokens for m in finals)
    log.info("request", request_id=call_id, tenant=tenant, endpoint=req.kind, outcome=outcome,
             prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
             cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
             ttft_s=round(min(ttfts), 6) if ttfts else None,
             finish_reason=[c.finish_reason for c in gen.choices], user=log_text(req.user),
             spec_acceptance=round(sum(m.num_accepted_tokens for m in finals) / drafted, 4)
             if drafted else None)

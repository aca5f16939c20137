"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same Call,
engine run (service.openai_routes.respond) and tool layer as chat completions."""

from __future__ import annotations

from aiohttp import web

from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.messages_format import MessagesFormat
from kvcore.service.messages_protocol import parse_messages
from kvcore.service.openai_routes import refusals_logged, respond, tokenized
from kvcore.service.state import STATE_KEY, TENANT_KEY, read_json


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    with refusals_logged(tenant, "messages"):
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        call = parse_messages(body, engine.model_config.vocab_size, state.tools())
        name = await tokenized(state, tenant, call, "msg")
    return await respond(request, state, call, MessagesFormat(call, name), tenant)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's token count, as /v1/messages would see it ({"input_tokens": N})."""
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    body = await read_json(request, state.max_body_size, state.body_timeout)
    engine = state.ready_engine()
    call = parse_messages(body, engine.model_config.vocab_size, state.tools(), count_only=True)
    await tokenized(state, tenant, call, "count")
    return web.json_response({"input_tokens": len(call.prompt_ids[0])})

"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the same
Call, engine run (service.openai_routes.respond) and tool layer as chat completions; stored
responses are the tenant's own (another tenant's id is a 404, as an unknown one)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.errors import APIError
from kvcore.service.fields import get_str
from kvcore.service.openai_routes import refusals_logged, respond, tokenized
from kvcore.service.responses_format import ResponsesFormat
from kvcore.service.responses_protocol import parse_responses
from kvcore.service.state import STATE_KEY, TENANT_KEY, ServiceState, read_json


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    with refusals_logged(tenant, "responses"):
        body = await read_json(request, state.max_body_size, state.body_timeout)
        engine = state.ready_engine()
        previous = get_str(body, "previous_response_id")
        history: list[dict[str, Any]] = []
        if previous is not None:
            history = _stored(state, tenant, previous, "previous_response_id").conversation
        call, req = parse_responses(body, engine.model_config.vocab_size, state.tools(),
                                    history)
        name = await tokenized(state, tenant, call, "resp", "input")

    def store(response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        state.responses.put(tenant, response, conversation)

    return await respond(request, state, call, ResponsesFormat(call, name, req, store), tenant)


async def get_response(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    return web.json_response(_stored(state, tenant, request.match_info["id"], "id").response)


async def delete_response(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    tenant = request.get(TENANT_KEY, ANONYMOUS_TENANT)
    response_id = request.match_info["id"]
    if not state.responses.delete(tenant, response_id):
        raise _not_found(response_id, "id")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _stored(state: ServiceState, tenant: str, response_id: str, param: str) -> Any:
    entry = state.responses.get(tenant, response_id)
    if entry is None:
        raise _not_found(response_id, param)
    return entry


def _not_found(response_id: str, param: str) -> APIError:
    # the same answer for an unknown, expired or another tenant's id: nothing is revealed
    return APIError(404, f"No response found with id {response_id[:64]!r}", param=param,
                    code="not_found")

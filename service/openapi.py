"""The OpenAPI 3.1 document of the service's routes (GET /openapi.json)."""

from __future__ import annotations

from typing import Any

import kvcore

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}

# fields both generation endpoints accept (OpenAI names, then vLLM's extensions); their types
# only: the ranges are SamplingParams' (a value out of range is a 400 naming the field)
_SAMPLING: dict[str, Any] = {
    "model": _STR, "n": _INT, "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "seed": _INT,
    "stop": {"oneOf": [_STR, {"type": "array", "items": _STR}]}, "stop_token_ids": _IDS,
    "max_tokens": _INT, "min_tokens": _INT, "presence_penalty": _NUM,
    "frequency_penalty": _NUM, "repetition_penalty": _NUM,
    "logit_bias": {"type": "object", "additionalProperties": _NUM},
    "ignore_eos": _BOOL, "echo": _BOOL, "user": _STR, "priority": _INT,
    "cache_salt": {"type": "string", "minLength": 1}, "use_beam_search": _BOOL,
    "length_penalty": _NUM, "early_stopping": {"oneOf": [_BOOL, {"const": "never"}]},
    "skip_special_tokens": _BOOL, "include_stop_str_in_output": _BOOL,
}
_MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"oneOf": [_STR, {"type": "array"}, {"type": "null"}]}}}}
_COMPLETION_BODY = {"type": "object", "required": ["prompt"], "properties": _SAMPLING | {
    "prompt": {"oneOf": [_STR, {"type": "array", "items": _STR}, _IDS,
                         {"type": "array", "items": _IDS}]},
    "logprobs": _INT}}
_CHAT_BODY = {"type": "object", "required": ["messages"], "properties": _SAMPLING | {
    "messages": _MESSAGES, "max_completion_tokens": _INT, "logprobs": _BOOL,
    "top_logprobs": _INT,
    "add_generation_prompt": _BOOL}}
_ERROR = {"description": "OpenAI-shaped error", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "integer", "null"]}}}}}}}}
_ERRORS = {str(s): _ERROR for s in (400, 401, 404, 413, 429, 503)}
_STREAMS: dict[str, Any] = {"application/json": {}, "text/event-stream": {},
                            "application/x-msgpack": {}}


_RESPONSES_BODY = {"type": "object", "required": ["model", "input"], "properties": {
    "model": _STR, "input": {"type": ["string", "array"]}, "instructions": _STR,
    "tools": {"type": "array"}, "previous_response_id": _STR, "store": _BOOL, "stream": _BOOL,
    "max_output_tokens": _INT, "text": {"type": "object"}}}
_MESSAGES_BODY = {"type": "object", "required": ["model", "messages"], "properties": {
    "model": _STR, "max_tokens": _INT, "system": {"type": ["string", "array"]},
    "messages": {"type": "array"}, "tools": {"type": "array"},
    "tool_choice": {"type": "object"}, "stream": _BOOL}}
_EVENTS: dict[str, Any] = {"application/json": {}, "text/event-stream": {}}


def _post(summary: str, schema: dict[str, Any], produces: dict[str, Any]) -> dict[str, Any]:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": schema}}},
                     "responses": {"200": {"description": "OK", "content": produces}} | _ERRORS}}


def _get(summary: str, content_type: str = "application/json",
         admin: bool = False) -> dict[str, Any]:
    errors = _ERRORS | ({"403": _ERROR} if admin else {})  # 403: a key that is not an admin's
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {content_type: {}}}} | errors}}


def openapi_document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvcore OpenAI-compatible server", "version": kvcore.__version__},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _post("Text completion (stream: SSE; Accept msgpack: frames)",
                                     _COMPLETION_BODY, _STREAMS),
            "/v1/chat/completions": _post("Chat completion (stream: SSE; Accept msgpack: frames)",
                                          _CHAT_BODY, _STREAMS),
            "/v1/responses": _post("OpenAI Responses API (stream: named SSE events)",
                                   _RESPONSES_BODY, _EVENTS),
            "/v1/responses/{id}": _get("A stored response of the caller's tenant") | {
                "delete": {"summary": "Delete a stored response",
                           "responses": {"200": {"description": "OK"}} | _ERRORS}},
            "/v1/messages": _post("Anthropic Messages API (x-api-key or Bearer; stream: named "
                                  "SSE events; Anthropic-shaped errors)", _MESSAGES_BODY,
                                  _EVENTS),
            "/v1/messages/count_tokens": _post("Prompt tokens of a Messages body",
                                               _MESSAGES_BODY, {"application/json": {}}),
            "/v1/models": _get("The served model"),
            "/tokenize": _post("Token ids of a prompt or a chat", {
                "type": "object", "properties": {"prompt": _STR, "messages": _MESSAGES,
                                                 "add_special_tokens": _BOOL,
                                                 "add_generation_prompt": _BOOL,
                                                 "return_token_strs": _BOOL}},
                               {"application/json": {}}),
            "/detokenize": _post("Text of token ids", {
                "type": "object", "required": ["tokens"], "properties": {"tokens": _IDS}},
                                 {"application/json": {}}),
            "/health": _get("200 when ready; 503 while loading or draining"),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/version": _get("kvcore version"),
            "/openapi.json": _get("This document"),
            "/inspector": _get("The KV inspector page (admin key when keys are configured)",
                               "text/html", admin=True),
            "/debug/kv": _get("The KV inspector's snapshot: block map, requests, planner, "
                              "10-minute series (admin key when keys are configured)", admin=True),
        },
        "security": [{"bearer": []}],
    }

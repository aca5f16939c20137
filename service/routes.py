"""The non-generating endpoints: models, tokenize, detokenize, health, metrics, version, openapi."""

from __future__ import annotations

import json

from aiohttp import web

import kvcore
from kvcore.model.tokenizer import Tokenizer
from kvcore.service.auth import ANONYMOUS_TENANT
from kvcore.service.call import Call
from kvcore.service.errors import bad_request
from kvcore.service.fields import as_int, get_bool
from kvcore.service.openapi import openapi_document
from kvcore.service.protocol import check_prompt_chars, parse_chat
from kvcore.service.state import READY, STATE_KEY, TENANT_KEY, read_json
from kvcore.service.tool_format import chat_text


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if state.status != READY:
        return web.json_response({"status": state.status}, status=503)
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    engine = state.ready_engine()
    data = [{"id": name, "object": "model", "created": state.created, "owned_by": "kvcore",
             "root": state.served_model_names[0], "parent": None,
             "max_model_len": engine.max_model_len} for name in state.served_model_names]
    return web.json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json(request, state.max_body_size, state.body_timeout)
    engine = state.ready_engine()
    if body.get("model") is not None:
        state.model_name(body["model"] if isinstance(body["model"], str) else str(body["model"]))
    messages = None
    if "messages" in body:
        messages = parse_chat({"messages": body["messages"],
                               "add_generation_prompt": body.get("add_generation_prompt")},
                              engine.model_config.vocab_size, state.tools())
        add_special = get_bool(body, "add_special_tokens", False)
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad_request("prompt must be a string (or send messages)", "prompt")
        add_special = get_bool(body, "add_special_tokens", True)
    token_strs = get_bool(body, "return_token_strs", False)
    # generation's length bound, before any work: a text no context could hold is refused
    # untokenized, and a count past max_model_len after tokenizing
    if messages is not None:
        check_prompt_chars("".join(m["content"] for m in messages.messages),
                           engine.max_model_len, engine.tokenizer.max_token_chars, "messages")
    else:
        check_prompt_chars(body["prompt"], engine.max_model_len,
                           engine.tokenizer.max_token_chars, "prompt")
    # request-sized CPU work (tokens and their JSON): off the loop, tenants taking turns
    answer = await state.offload(request.get(TENANT_KEY, ANONYMOUS_TENANT), _tokenize,
                                 engine.tokenizer, body.get("prompt"), messages, add_special,
                                 token_strs, engine.max_model_len)
    return web.Response(body=answer, content_type="application/json")


def _tokenize(tokenizer: Tokenizer, prompt: str | None, chat: Call | None,
              add_special: bool, token_strs: bool, max_model_len: int) -> bytes:
    if chat is not None:  # the text generation would see
        prompt = chat_text(chat, tokenizer, chat.tool_format)
    assert prompt is not None
    tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
    if len(tokens) > max_model_len:
        param = "messages" if chat is not None else "prompt"
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; "
                          f"the {param} has {len(tokens)}", param)
    strs = [tokenizer.id_to_token(t) for t in tokens] if token_strs else None
    return json.dumps({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                       "token_strs": strs}).encode()


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await read_json(request, state.max_body_size, state.body_timeout)
    engine = state.ready_engine()
    raw = body.get("tokens")
    if not isinstance(raw, list):
        raise bad_request("tokens must be an array of token ids", "tokens")
    if len(raw) > engine.max_model_len:  # generation's bound, before any work
        raise bad_request(f"This model's maximum context length is {engine.max_model_len} "
                          f"tokens; tokens has {len(raw)}", "tokens")
    tokens = [as_int(t, "tokens", 0, engine.model_config.vocab_size - 1) for t in raw]
    text = await state.offload(request.get(TENANT_KEY, ANONYMOUS_TENANT),
                               engine.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": kvcore.__version__})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


PUBLIC_HANDLERS = frozenset({health, metrics, version, openapi})

"""An OpenAI Responses body (POST /v1/responses) -> a chat Call: `input` items (and a stored
conversation through `previous_response_id`) become chat messages, `tools`, `tool_choice` and
`text.format` the chat body's, so values are checked once, by the chat parser, and its 400s are
renamed to the Responses fields they came from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.service.call import Call
from kvcore.service.errors import APIError, bad_request
from kvcore.service.fields import get_bool, get_str
from kvcore.service.messages_protocol import EXTENSIONS, renamed
from kvcore.service.protocol import parse_chat
from kvcore.service.tool_format import ChatTools

# fields this server cannot honour: refused by name unless they hold their default
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "conversation": (None,), "prompt": (None,),
    "include": (None, []), "truncation": (None, "disabled"), "max_tool_calls": (None,),
    "reasoning": (None, {}), "top_logprobs": (None, 0)}
KNOWN = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
         "max_output_tokens", "temperature", "top_p", "seed", "stream", "store",
         "previous_response_id", "metadata", "user", "service_tier", "prompt_cache_key",
         "safety_identifier", "stream_options", *EXTENSIONS, *UNSUPPORTED}
PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
          "messages": "input"}


@dataclass(slots=True)
class ResponsesRequest:
    """What the Response object echoes back and what storing it needs."""

    body: dict[str, Any]
    store: bool
    history: list[dict[str, Any]]  # chat messages before this call's (from a stored response)
    new: list[dict[str, Any]]  # this call's input as chat messages


def parse_responses(body: dict[str, Any], vocab_size: int, tools: ChatTools,
                    history: list[dict[str, Any]]) -> tuple[Call, ResponsesRequest]:
    """The Call of a Responses body after `history` (the stored conversation it continues)."""
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise bad_request(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise bad_request(f"{unknown[0]} is not a Responses API field", unknown[0])
    known_ids = {c["id"] for m in history for c in m.get("tool_calls", [])}
    new = _input(body.get("input"), known_ids)
    instructions = get_str(body, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {
        "model": body.get("model"), "messages": system + history + new,
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "seed": body.get("seed"), "stream": body.get("stream"), "user": body.get("user"),
        "response_format": _format(body.get("text")),
        **_tools(body.get("tools"), body.get("tool_choice")),
        "parallel_tool_calls": body.get("parallel_tool_calls"),
        **{name: body.get(name) for name in EXTENSIONS if name != "seed"}}
    try:
        call = parse_chat({k: v for k, v in chat.items() if v is not None}, vocab_size, tools)
    except APIError as e:
        raise renamed(e, PARAMS, "parameters") from None
    return call, ResponsesRequest(body, get_bool(body, "store", True), history, new)


def _input(value: Any, known_ids: set[str]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role must be user, assistant, system or developer",
                                  f"{where}.role")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments "
                                  "(strings)", where)
            known_ids.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in known_ids:
                raise bad_request(f"{where}.call_id answers no function_call of this "
                                  "conversation", f"{where}.call_id")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str)
                        else _content(output, f"{where}.output")})
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", f"{where}.type")
    return out


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}.content must be a string or an array of parts",
                          f"{where}.content")
    texts = []
    for j, part in enumerate(value):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else None
            raise bad_request(f"{where}.content[{j}].type {kind!r}: only text parts "
                              "(input_text, output_text) are supported",
                              f"{where}.content[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    return fmt  # text, json_object (anything else: the chat parser's 400)


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    if tools is None:
        return {"tool_choice": choice} if choice not in (None, "auto", "none") else {}
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r}: only function tools are supported "
                              "(no built-in tools)", f"tools[{i}].type")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    chat: dict[str, Any] = {"tools": out}
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request("tool_choice must be auto, none, required or {\"type\": "
                              "\"function\", \"name\": ...}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat

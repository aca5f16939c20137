"""An Anthropic Messages body (POST /v1/messages) -> a chat Call: translated into the chat body
the chat parser reads (so the values are checked once, in one place), and its 400s renamed to
the Messages fields they came from."""

from __future__ import annotations

import json
from typing import Any

from kvcore.service.call import Call
from kvcore.service.errors import APIError, bad_request
from kvcore.service.fields import get_object
from kvcore.service.protocol import parse_chat
from kvcore.service.tool_format import ChatTools

# fields of the Messages API this server cannot honour: refused by name (a value equal to the
# default passes)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}), "mcp_servers": (None, []), "container": (None,),
    "context_management": (None,), "output_format": (None,)}
# sampling fields beyond the Messages API that kvcore's chat completions take (as vLLM's
# Messages server does), passed through as they are
EXTENSIONS = ("seed", "logit_bias", "ignore_eos", "min_tokens", "repetition_penalty",
              "presence_penalty", "frequency_penalty", "min_p", "cache_salt", "priority")
KNOWN = {"model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences",
         "temperature", "top_p", "top_k", "metadata", "stream", "service_tier", *EXTENSIONS,
         *UNSUPPORTED}
# the chat body's names -> the Messages names, for a 400's `param`
PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
          "user": "metadata.user_id", "parallel_tool_calls": "tool_choice"}


def parse_messages(body: dict[str, Any], vocab_size: int, tools: ChatTools,
                   count_only: bool = False) -> Call:
    """The Call of a Messages body; a 400 names the Messages field."""
    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise bad_request(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise bad_request(f"{unknown[0]} is not a Messages API field", unknown[0])
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("max_tokens is required", "max_tokens")
    chat: dict[str, Any] = {
        "model": body.get("model"), "max_completion_tokens": body.get("max_tokens"),
        "messages": _system(body.get("system")) + _messages(body.get("messages")),
        "stop": body.get("stop_sequences"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stream": body.get("stream"),
        **_tools(body.get("tools"), body.get("tool_choice")),
        **{name: body.get(name) for name in EXTENSIONS}}
    metadata = get_object(body, "metadata") or {}
    chat["user"] = metadata.get("user_id")
    try:
        return parse_chat({k: v for k, v in chat.items() if v is not None}, vocab_size, tools)
    except APIError as e:
        raise renamed(e, PARAMS) from None


def renamed(error: APIError, names: dict[str, str], schema: str = "input_schema") -> APIError:
    """The chat parser's error under the field names of the API that was called."""
    param = error.param
    if param is not None:
        for chat_name, name in names.items():
            if param == chat_name or param.startswith((chat_name + ".", chat_name + "[")):
                param = name + param[len(chat_name):]
        param = param.replace(".function.parameters", f".{schema}").replace(
            ".function.", ".")
    return APIError(error.status, error.message, param=param, headers=error.headers)


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    return [{"role": "system", "content": _text(value, "system")}]


def _text(value: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a string or an array of text blocks", where)
    out = []
    for i, block in enumerate(value):
        if not (isinstance(block, dict) and block.get("type") == "text"
                and isinstance(block.get("text"), str)):
            raise bad_request(f"{where}[{i}] must be a text block ({{\"type\": \"text\", "
                              f"\"text\": ...}}): this server serves text only", f"{where}[{i}]")
        out.append(block["text"])
    return "".join(out)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    call_ids: set[str] = set()  # tool_use ids so far: a tool_result answers one of them
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be \"user\" or \"assistant\"", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or an array of blocks",
                              f"{where}.content")
        out += (_assistant(content, where, call_ids) if message["role"] == "assistant"
                else _user(content, where, call_ids))
    return out


def _assistant(blocks: list[Any], where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    text, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and block["id"]
                    and isinstance(block.get("name"), str) and isinstance(block.get("input"),
                                                                          dict)):
                raise bad_request(f"{at}: a tool_use block needs id, name and input (an "
                                  "object)", at)
            call_ids.add(block["id"])
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier reasoning: not part of this model's prompt
        else:
            raise bad_request(f"{at}.type {kind!r} is not supported in an assistant message "
                              "(text, tool_use)", f"{at}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _user(blocks: list[Any], where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    results, text = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if call_id not in call_ids:
                raise bad_request(f"{at}.tool_use_id answers no earlier tool_use block",
                                  f"{at}.tool_use_id")
            content = block.get("content", "")
            result = _text(content, f"{at}.content")
            if block.get("is_error") is True:
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": result})
        else:
            raise bad_request(f"{at}.type {kind!r} is not supported in a user message (text, "
                              "tool_result)", f"{at}.type")
    return results + ([{"role": "user", "content": "".join(text)}] if text else [])


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """Messages' tools and tool_choice as the chat body's tools, tool_choice and
    parallel_tool_calls."""
    if tools is None:
        kind = choice.get("type") if isinstance(choice, dict) else choice
        if kind not in (None, "auto", "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return {}
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}].type {kind!r}: only custom tools (name, "
                              "input_schema) are supported", f"tools[{i}].type")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object",
                              f"tools[{i}].input_schema")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description") or "",
            "parameters": tool["input_schema"]}})
    chat: dict[str, Any] = {"tools": out}
    if choice is None:
        return chat
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be an object with a type", "tool_choice")
    kind = choice.get("type")
    chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif chat["tool_choice"] is None:
        raise bad_request(f"tool_choice.type must be auto, any, tool or none, got {kind!r}",
                          "tool_choice.type")
    parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(parallel, bool):
        raise bad_request("tool_choice.disable_parallel_tool_use must be a boolean",
                          "tool_choice.disable_parallel_tool_use")
    chat["parallel_tool_calls"] = not parallel
    return chat

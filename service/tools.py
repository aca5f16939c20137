"""OpenAI tool calling: `tools` / `tool_choice` / `parallel_tool_calls` in, the constraint and the
prompt's tool messages out, and the model's calls parsed back into `tool_calls`.

Calls are written in the Hermes format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`: the native format of Qwen2.5 / Qwen3 templates (which render `tools` and
`tool_calls` themselves). A template without tool support (the default SmolLM2) gets the tools
described in a system message asking for the same format, earlier calls written into the
assistant turns and results as `<tool_response>` user turns. "required" and a named function
constrain the whole answer to calls whose arguments match the function's `parameters`; "auto"
leaves text free and constrains a call's body once `<tool_call>` starts it. Which format a
template gets (this one, its fallback, or Llama 3.1's JSON calls) is tool_format's choice."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from kvcore.sampling.constraints import JSON_OPTIONS, Constraint
from kvcore.service.errors import bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    mode: str  # "auto", "required" or "named"
    named: str | None  # the function tool_choice names
    parallel: bool
    raw: list[dict[str, Any]]  # the request's `tools`, for a template that renders them
    format: str = "hermes"  # the chat template's tool-call format (tool_format.FORMATS)


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The call's tool request (None: no tools, or tool_choice "none"); 400s name the field."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad_request(f"tools must be an array of at most {MAX_TOOLS} tools", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", "tools")
    named = None
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "required"
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)):
        named = choice["function"].get("name")
        if named not in names:
            raise bad_request(f"tool_choice names function {named!r}, which is not in tools",
                              "tool_choice")
        mode = "named"
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                          '"function", "function": {"name": ...}}', "tool_choice")
    return ToolRequest(tools, mode, named, parallel, raw)


def _tool(value: Any, i: int) -> Tool:
    if not (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("function"), dict)):
        raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                          "tools")
    fn = value["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, "
                          f"got {name!r}", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise bad_request(f"tools[{i}].function.parameters must be a JSON schema of an object",
                          f"tools[{i}].function.parameters")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad_request(f"tools[{i}].function.description must be a string", "tools")
    if not isinstance(fn.get("strict", False), bool | None):
        raise bad_request(f"tools[{i}].function.strict must be a boolean, got "
                          f"{fn['strict']!r}", f"tools[{i}].function.strict")
    return Tool(name, description, params)


def tool_constraint(req: ToolRequest) -> Constraint:
    """The grammar of the answer: only calls ("required", named), or text with calls."""
    tools = [t for t in req.tools if req.named is None or t.name == req.named]
    if req.mode == "auto":
        tags = [llguidance.StructTag(trigger=OPEN, begin=f'{OPEN}\n{{"name": "{t.name}", '
                                     f'"arguments": ', grammar=_strict(t.parameters),
                                     end=f"}}\n{CLOSE}") for t in tools]
        return Constraint("grammar", llguidance.StructTag.to_grammar(tags, assume_special=False),
                          "tools")
    body = _strict({"anyOf": [{
        "type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]})
    repeat = ' ("\\n" call)*' if req.parallel else ""
    grammar = (f"%llguidance {{}}\nstart: call{repeat}\n"
               f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(body)} "
               f"{json.dumps(chr(10) + CLOSE)}\n")
    return Constraint("grammar", grammar, "tools")


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": JSON_OPTIONS}


def structured_kind(call: Any) -> str | None:
    """The metrics label of a Call's constraint (None: free text)."""
    if call.tools is not None:
        return f"tools_{call.tools.mode}"
    constraint = call.params.constraint
    return None if constraint is None else str(constraint.kind)


def render_messages(messages: list[dict[str, Any]], req: ToolRequest | None, native: bool
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. Native: as they are, arguments as objects;
    otherwise the tools in a system message and calls / results written as text."""
    if native:
        return [_native(m) for m in messages], (req.raw if req is not None else None)
    out = [_fallback(m) for m in messages]
    if req is not None:
        prompt = _tools_prompt(req.tools)
        if out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _native(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls]}


def _fallback(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"]}
    text = "\n".join(call_text(c["function"]["name"], _arguments(c)) for c in calls)
    return {"role": message["role"], "content": (message["content"] + "\n" + text).lstrip()}


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call["function"].get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise bad_request("tool_calls[].function.arguments must be a JSON object string",
                          "messages") from None


def call_text(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _tools_prompt(tools: tuple[Tool, ...]) -> str:
    lines = [json.dumps({"name": t.name, "description": t.description,
                         "parameters": t.parameters}, ensure_ascii=False) for t in tools]
    return ("You may call one or more functions to answer. The functions:\n"
            + "\n".join(lines) + f"\nTo call a function, answer with {OPEN}\n"
            '{"name": <function name>, "arguments": <arguments as a JSON object>}\n'
            f"{CLOSE} for each call. Function results come back in <tool_response> tags.")


def parse_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished answer; a call that does not parse (cut
    by max_tokens) stays in the content."""
    calls = []
    content = text
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not (isinstance(body, dict) and isinstance(body.get("name"), str)):
            continue
        calls.append(tool_call(body["name"], _arguments_text(match.group(1), body)))
        content = content.replace(match.group(0), "", 1)
    content = content.strip()
    return (content or None), calls


def _arguments_text(text: str, body: dict[str, Any]) -> str:
    """The arguments as the model wrote them (what a stream sends), else re-serialized."""
    head = _HEAD.match(text)
    if head is not None:
        raw = text[head.end():].rstrip()[:-1].rstrip()  # without the call object's "}"
        try:
            if json.loads(raw) == body.get("arguments"):
                return raw
        except ValueError:
            pass
    return json.dumps(body.get("arguments", {}), ensure_ascii=False, separators=(",", ":"))


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}

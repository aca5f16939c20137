"""Llama 3.1's JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`; several calls separated by `;`), results come back as `ipython` / `tool`
turns. "required" and a named function constrain the whole answer to such calls; "auto" leaves
text free unless the answer starts with `{`, which begins a call constrained from there. One
parser serves streamed and whole answers (a whole answer is the stream parser fed all of it); a
call cut by `length` is a call whose arguments are the text generated so far."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from kvcore.sampling.constraints import Constraint
from kvcore.service.tools import ToolRequest, calls_grammar, fold_calls, tool_call

PYTHON_TAG = "<|python_tag|>"
SEP = ";"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')
_DECODER = json.JSONDecoder()


def llama3_constraint(req: ToolRequest, token_id: Callable[[str], int | None]) -> Constraint:
    """Calls only ("required", named), or ("auto") calls or text whose first non-blank is not
    `{` (with a response format: calls or its JSON answer); calls may follow `<|python_tag|>`
    where the tokenizer has it (`token_id`: its id)."""
    tools = [t for t in req.tools if req.named is None or t.name == req.named]
    calls = [(f'{{"name": "{t.name}", "parameters": ', t.parameters, "}") for t in tools]
    extra = " | TEXT" if req.mode == "auto" and req.answer is None else ""
    tag = token_id(PYTHON_TAG)
    if tag is not None:
        extra += f" | <[{tag}]> calls"
    grammar = calls_grammar(calls, SEP + " " if req.parallel else None,
                            req.answer if req.mode == "auto" else None, extra)
    return Constraint("grammar", grammar + "TEXT: /(\\s*[^{\\s][\\s\\S]*)?/\n", "tools")


def parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a whole answer: the stream parser fed all of it."""
    content, items = Llama3CallStream().feed(text, True)
    return content or None, fold_calls(items)


def _strip_tag(text: str) -> str:
    return text[len(PYTHON_TAG):].lstrip() if text.startswith(PYTHON_TAG) else text


def _one_call(text: str) -> tuple[dict[str, Any], int] | None:
    """The call at the start of `text` and where it ends, or None."""
    try:
        body, end = _DECODER.raw_decode(text)
    except ValueError:
        return None
    head = _HEAD.match(text)
    if not (isinstance(body, dict) and isinstance(body.get("name"), str) and head):
        return None
    params = body.get("parameters", body.get("arguments", {}))
    if not isinstance(params, dict):
        return None
    raw = text[head.end():end - 1].rstrip()  # the parameters as written, without the "}"
    try:
        same = json.loads(raw) == params
    except ValueError:
        same = False
    arguments = raw if same else json.dumps(params, ensure_ascii=False, separators=(",", ":"))
    return tool_call(body["name"], arguments), end


class Llama3CallStream:
    """One choice's text in, (content delta, tool_calls delta items) out: the answer is content
    unless it starts with `{`; then each call's id and name, then its argument fragments."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # characters of `text` handled
        self.state = "start"  # "start", "content", "head", "args", "between"
        self.num_calls = 0
        self.args_sent = 0  # argument characters of the open call already sent
        self.call_start = 0  # where the open call's "{" is in `text`
        self.args_start = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls delta items) of the text fed so far."""
        out = self.events(delta, final)
        return ("".join(e for e in out if isinstance(e, str)),
                [e for e in out if not isinstance(e, str)])

    def events(self, delta: str, final: bool) -> list[str | dict[str, Any]]:
        """The same, in the answer's order: content (str) and tool_calls items (dict)."""
        self.text += delta
        out: list[str | dict[str, Any]] = []
        while True:
            rest = self.text[self.pos:]
            if self.state == "start":
                body = rest.lstrip()
                if PYTHON_TAG.startswith(body) and body and not final:
                    break  # it may be the tag
                body = _strip_tag(body)
                if not body and not final:
                    break
                self.state = "head" if body.startswith("{") else "content"
                if self.state == "head":
                    self.pos = len(self.text) - len(body)
            elif self.state == "content":
                out.append(rest)
                self.pos = len(self.text)
                break
            elif self.state == "head":
                match = _HEAD.match(rest)
                if match is None or match.end() == len(rest):
                    if final:  # never became a call: the rest is content
                        out.append(rest)
                        self.pos, self.state = len(self.text), "content"
                    break
                out.append({"index": self.num_calls, **tool_call(match.group(1), "")})
                self.call_start, self.args_start = self.pos, self.pos + match.end()
                self.pos, self.state, self.args_sent = self.args_start, "args", 0
            elif self.state == "args":
                found = _one_call(self.text[self.call_start:])
                if found is not None:
                    arguments, end = found[0]["function"]["arguments"], found[1]
                else:
                    body = self.text[self.args_start:].rstrip()
                    arguments, end = body[:-1] if body.endswith("}") else body, 0
                if len(arguments) > self.args_sent:
                    out.append({"index": self.num_calls,
                                  "function": {"arguments": arguments[self.args_sent:]}})
                    self.args_sent = len(arguments)
                if found is None:
                    if final:
                        self.pos = len(self.text)
                    break
                self.pos, self.state = self.call_start + end, "between"
                self.num_calls += 1
            else:  # between calls: blanks and ";" are no content
                body = rest.lstrip()
                if body.startswith(SEP):
                    self.pos, self.state = len(self.text) - len(body) + 1, "head"
                    continue
                if body:
                    self.state = "content"
                    continue
                break
        return [e for e in out if e != ""]

"""The tool-call format of a chat template: how tools and earlier calls reach the prompt, the
constraint of the answer and the parsers of the model's calls. "hermes": the template renders
`tools` and writes calls in `<tool_call>` tags (Qwen2.5 / Qwen3); "llama3_json": the template
renders `tools` and calls are a JSON object `{"name", "parameters"}`, results `ipython` turns
(Llama 3.1 / 3.2); "fallback": any other template, the tools described in a system message and
calls asked for in Hermes tags."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvcore.config import ParamError
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling.constraints import Constraint
from kvcore.service.errors import bad_request
from kvcore.service.tool_llama3 import Llama3CallStream, llama3_constraint, parse_llama3
from kvcore.service.tool_stream import ToolCallStream
from kvcore.service.tools import OPEN, ToolRequest, parse_calls, render_messages, tool_constraint


class CallStream(Protocol):
    num_calls: int

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]: ...


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    native: bool  # the template renders `tools` and `tool_calls` itself
    # the answer's constraint; the second argument finds a special token's id in the vocabulary
    constraint: Callable[[ToolRequest, Callable[[str], int | None]], Constraint]
    parse: Callable[[str], tuple[str | None, list[dict[str, Any]]]]
    stream: Callable[[], CallStream]

    def render(self, messages: list[dict[str, Any]], req: ToolRequest | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template."""
        return render_messages(messages, req, self.native)


def _hermes_constraint(req: ToolRequest, token_id: Callable[[str], int | None]) -> Constraint:
    return tool_constraint(req)  # its tags are text


HERMES = ToolFormat("hermes", True, _hermes_constraint, parse_calls, ToolCallStream)
LLAMA3_JSON = ToolFormat("llama3_json", True, llama3_constraint, parse_llama3, Llama3CallStream)
FALLBACK = ToolFormat("fallback", False, _hermes_constraint, parse_calls, ToolCallStream)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, FALLBACK)}


def tool_format(template: str | None) -> ToolFormat:
    """The format of a chat template, by the conventions its text names."""
    if template is None:
        return FALLBACK
    if OPEN in template:
        return HERMES
    if "tools" in template and "ipython" in template and '"parameters"' in template:
        return LLAMA3_JSON
    return FALLBACK


def chat_text(call: Any, tokenizer: Tokenizer) -> str:
    """The prompt text of a chat Call: its messages (and tools) in the template's format,
    rendered by the chat template (a 400 naming `messages` when the template refuses them)."""
    messages, tools = tool_format(tokenizer.chat_template).render(call.messages, call.tools)
    try:
        return tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=call.add_generation_prompt,
                                             tools=tools)
    except ValueError as e:  # the template refused the conversation (roles, order)
        raise bad_request(f"chat template: {e}", "messages") from None


def with_format(call: Any, tokenizer: Tokenizer) -> Any:
    """A chat Call with tools, its tools and constraint in the format of the tokenizer's chat
    template."""
    if call.tools is None:
        return call
    fmt = tool_format(tokenizer.chat_template)
    tools = dataclasses.replace(call.tools, format=fmt.name)
    try:  # a combined grammar past the size bound names `tools`
        constraint = fmt.constraint(tools, tokenizer.token_to_id)
    except ParamError as e:
        raise bad_request(str(e), e.param) from None
    return dataclasses.replace(call, tools=tools,
                               params=dataclasses.replace(call.params, constraint=constraint))

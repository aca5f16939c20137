"""The tool-call format of a chat template: how tools and earlier calls reach the prompt, the
constraint of the answer and the parsers of the model's calls. "hermes": the template renders
`tools` and writes calls in `<tool_call>` tags (Qwen2.5 / Qwen3); "llama3_json": the template
renders `tools` and calls are a JSON object `{"name", "parameters"}`, results `ipython` turns
(Llama 3.1 / 3.2); "fallback": any other template, the tools described in a system message and
calls asked for in Hermes tags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvcore.config import ParamError
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling.constraints import Constraint
from kvcore.service.errors import bad_request
from kvcore.service.tool_llama3 import Llama3CallStream, llama3_constraint
from kvcore.service.tool_stream import ToolCallStream
from kvcore.service.tools import (
    OPEN,
    ToolRequest,
    fold_calls,
    render_messages,
    tool_constraint,
)


class CallStream(Protocol):
    num_calls: int

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]: ...

    def events(self, delta: str, final: bool) -> list[str | dict[str, Any]]: ...


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    native: bool  # the template renders `tools` and `tool_calls` itself
    # the answer's constraint; the second argument finds a special token's id in the vocabulary
    constraint: Callable[[ToolRequest, Callable[[str], int | None]], Constraint]
    stream: Callable[[], CallStream]  # the one parser of an answer, streamed or whole

    def render(self, messages: list[dict[str, Any]], req: ToolRequest | None
               ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools) for the chat template."""
        return render_messages(messages, req, self.native)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content or None, OpenAI tool_calls) of a whole answer: the stream parser fed the
        whole text, so it equals the stream's deltas joined."""
        content, items = self.stream().feed(text, True)
        return content or None, fold_calls(items)


def _hermes_constraint(req: ToolRequest, token_id: Callable[[str], int | None]) -> Constraint:
    return tool_constraint(req)  # its tags are text


HERMES = ToolFormat("hermes", True, _hermes_constraint, ToolCallStream)
LLAMA3_JSON = ToolFormat("llama3_json", True, llama3_constraint, Llama3CallStream)
FALLBACK = ToolFormat("fallback", False, _hermes_constraint, ToolCallStream)
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


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A tokenizer's tool format, chosen once (when the service's engine is ready)."""

    format: ToolFormat
    token_id: Callable[[str], int | None]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ChatTools:
        return cls(tool_format(tokenizer.chat_template), tokenizer.token_to_id)

    def constraint(self, req: ToolRequest) -> Constraint:
        """The answer's constraint (a combined grammar past the size bound names `tools`)."""
        try:
            return self.format.constraint(req, self.token_id)
        except ParamError as e:
            raise bad_request(str(e), e.param) from None


def _no_token(_text: str) -> int | None:
    return None


# a template without tool support (and the format tests get unless they name one)
FALLBACK_TOOLS = ChatTools(FALLBACK, _no_token)


def chat_text(call: Any, tokenizer: Tokenizer, fmt: ToolFormat) -> str:
    """The prompt text of a chat Call: its messages (and tools) in the template's format,
    rendered by the chat template (a 400 naming `messages` when the template refuses them)."""
    messages, tools = fmt.render(call.messages, call.tools)
    try:
        return tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=call.add_generation_prompt,
                                             tools=tools)
    except ValueError as e:  # the template refused the conversation (roles, order)
        raise bad_request(f"chat template: {e}", "messages") from None

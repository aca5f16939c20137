"""Streaming an answer that may hold tool calls: content deltas until `<tool_call>` opens a call,
then OpenAI's `delta.tool_calls` items (the id and name first, then argument fragments), as the
official client accumulates them."""

from __future__ import annotations

from typing import Any

from kvcore.service.tools import _HEAD, CLOSE, OPEN, tool_call

# characters held back while a call's arguments stream: they may be the call object's own "}"
# and the start of </tool_call>
_HOLD = len(CLOSE) + 4


class ToolCallStream:
    """One choice's text in, (content delta, tool_calls delta items) out."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # characters of `text` handled
        self.state = "content"  # "content", "head" (after <tool_call>), "args"
        self.num_calls = 0
        self.args_sent = 0  # argument characters of the open call already sent

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += delta
        content: list[str] = []
        items: list[dict[str, Any]] = []
        while True:
            rest = self.text[self.pos:]
            if self.state == "content":
                k = rest.find(OPEN)
                if k < 0:
                    keep = 0 if final else _partial(rest, OPEN)
                    content.append(rest[:len(rest) - keep])
                    self.pos += len(rest) - keep
                    break
                content.append(rest[:k])
                self.pos += k + len(OPEN)
                self.state = "head"
            elif self.state == "head":
                match = _HEAD.match(rest)
                if match is None or match.end() == len(rest):  # more blanks may follow
                    break
                call = tool_call(match.group(1), "")
                items.append({"index": self.num_calls, **call})
                self.pos += match.end()
                self.state, self.args_sent = "args", 0
            else:
                k = rest.find(CLOSE)
                body = rest if k < 0 else rest[:k].rstrip()
                end = max(len(body) - _HOLD, 0) if k < 0 else len(body) - 1  # drop the "}"
                if end > self.args_sent:
                    items.append({"index": self.num_calls,
                                  "function": {"arguments": body[self.args_sent:end]}})
                    self.args_sent = end
                if k < 0:
                    break
                self.pos += k + len(CLOSE)
                self.state = "content"
                self.num_calls += 1
        text = "".join(content)
        if self.num_calls and not text.strip():
            text = ""  # the line breaks between calls are no content
        return text, items


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be one)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

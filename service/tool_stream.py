"""The Hermes answer parser, streamed or whole: content until `<tool_call>` opens a call, then
OpenAI's `delta.tool_calls` items (the id and name first, then argument fragments), as the
official client accumulates them. A whole answer is this parser fed the whole text at once, so
streamed and whole answers are equal by construction.

Its rules, whatever the chunking: blanks next to a call (before `<tool_call>`, between calls,
after the last) are no content; any other text is content exactly as written. A call cut by
`length` is still a call: its arguments are what was generated (the JSON value when it is
complete, else the partial text), and the choice's finish_reason stays "length". Text after
`<tool_call>` that never became a call's head (cut, or not a call) is content, tag included."""

from __future__ import annotations

import json
from typing import Any

from kvcore.service.tools import _HEAD, CLOSE, OPEN, tool_call

# characters held back while a call's arguments stream: they may be the call object's own "}"
# and the start of </tool_call>
_HOLD = len(CLOSE) + 4
_DECODER = json.JSONDecoder()


class ToolCallStream:
    """One choice's text in, (content delta, tool_calls delta items) out."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # characters of `text` handled
        self.state = "content"  # "content", "head" (after <tool_call>), "args"
        self.num_calls = 0
        self.args_sent = 0  # argument characters of the open call already sent
        self.blank = ""  # blanks held back: no content if a call or the end follows a call

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
            if self.state == "content":
                k = rest.find(OPEN)
                if k < 0:
                    keep = 0 if final else _partial(rest, OPEN)
                    out.append(self._text(rest[:len(rest) - keep]))
                    self.pos += len(rest) - keep
                    break
                out.append(self._text(rest[:k]))
                self.blank = ""  # blanks before a call
                self.pos += k + len(OPEN)
                self.state = "head"
            elif self.state == "head":
                match = _HEAD.match(rest)
                if match is None or match.end() == len(rest):  # more blanks may follow
                    if final:  # never became a call's head: content, as written
                        out.append(self._text(OPEN + rest))
                        self.pos, self.state = len(self.text), "content"
                    break
                out.append({"index": self.num_calls, **tool_call(match.group(1), "")})
                self.pos += match.end()
                self.state, self.args_sent = "args", 0
            else:
                k = rest.find(CLOSE)
                if k >= 0:
                    end = len(rest[:k].rstrip()) - 1  # without the call object's "}"
                elif final:  # cut: the arguments' JSON value if complete, else all there is
                    end = _json_end(rest)
                else:
                    end = max(len(rest) - _HOLD, 0)
                if end > self.args_sent:
                    out.append({"index": self.num_calls,
                                  "function": {"arguments": rest[self.args_sent:end]}})
                    self.args_sent = end
                if k < 0 and not final:
                    break
                self.pos = self.pos + k + len(CLOSE) if k >= 0 else len(self.text)
                self.state = "content"
                self.num_calls += 1
        if final and not self.num_calls:
            out.append(self.blank)  # an answer without calls keeps its last blanks
            self.blank = ""
        return [e for e in out if e != ""]

    def _text(self, piece: str) -> str:
        """Content to send now: held blanks go out with the next text that is not blank."""
        piece = self.blank + piece
        body = piece.rstrip()
        self.blank = piece[len(body):]
        return body


def _json_end(text: str) -> int:
    """Where the JSON value at the start of `text` ends, or len(text) if it is incomplete."""
    try:
        return _DECODER.raw_decode(text)[1]
    except ValueError:
        return len(text)


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be one)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

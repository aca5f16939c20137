"""One choice's answer as ordered blocks (text, tool calls) for the APIs whose answers are lists
of blocks (Responses' output items, Messages' content blocks). Fed the choice's text deltas, it
says which block opens, grows and closes; a whole answer is the same deltas fed in order, so a
streamed answer and a whole one hold the same blocks by construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.service.tool_format import CallStream, ToolFormat


@dataclass(slots=True)
class Block:
    kind: str  # "text" or "call"
    index: int  # position in the answer
    text: str = ""  # the text, or the call's arguments as generated
    call_id: str = ""
    name: str = ""


# (what happened, the block, the text it gained): "start", "delta", "stop"
Event = tuple[str, Block, str]


class AnswerBlocks:
    """Text deltas in, block events out; with tools, the tool format's one parser splits calls
    from text (without tools all text is one block)."""

    def __init__(self, fmt: ToolFormat | None) -> None:
        self.parser: CallStream | None = fmt.stream() if fmt is not None else None
        self.blocks: list[Block] = []
        self.open: Block | None = None

    @property
    def num_calls(self) -> int:
        return sum(b.kind == "call" for b in self.blocks)

    def feed(self, delta: str, final: bool) -> list[Event]:
        pieces: list[str | dict[str, Any]] = (
            [delta] if self.parser is None else self.parser.events(delta, final))
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    events += self._grow("text", piece)
            elif "id" in piece:  # a call opens: its id and name
                events += self._close()
                events += self._start(Block("call", len(self.blocks), "", piece["id"],
                                            piece["function"]["name"]))
            else:
                events += self._grow("call", piece["function"]["arguments"])
        if final:
            events += self._close()
        return events

    def _grow(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open.kind != kind:
            events += self._close()
            events += self._start(Block(kind, len(self.blocks)))
        assert self.open is not None
        self.open.text += text
        return [*events, ("delta", self.open, text)]

    def _start(self, block: Block) -> list[Event]:
        self.blocks.append(block)
        self.open = block
        return [("start", block, "")]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [("stop", block, "")]


def whole(fmt: ToolFormat | None, deltas: list[str]) -> list[Block]:
    """The blocks of a whole answer: its deltas fed in order, the last one final."""
    answer = AnswerBlocks(fmt)
    for i, delta in enumerate(deltas or [""]):
        answer.feed(delta, i == len(deltas) - 1 or not deltas)
    return answer.blocks

"""Anthropic's Messages answer: a `message` object, or its stream of named SSE events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop). Text and
tool_use blocks come from service.answer_blocks, so streamed and whole answers hold the same
blocks."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kvcore.request import CompletionOutput
from kvcore.service.answer_blocks import AnswerBlocks, Block, Event, whole
from kvcore.service.call import Call
from kvcore.service.errors import APIError
from kvcore.service.streaming import sse_named


class MessagesFormat:
    content_type = "text/event-stream"
    streams_only = False

    def __init__(self, call: Call, model: str) -> None:
        self.call, self.model = call, model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.answer = AnswerBlocks(call.tool_format if call.tools is not None else None)

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        usage = self.call.usage()
        return {"input_tokens": usage["prompt_tokens"], "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"]}

    def _stop(self, num_calls: int) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) of the finished choice."""
        finish = self.call.finish_reasons.get(0)
        matched = self.call.stop_reasons.get(0)
        if finish == "length":
            return "max_tokens", None
        if num_calls:
            return "tool_use", None
        if isinstance(matched, str):
            return "stop_sequence", matched
        return ("end_turn" if finish is not None else None), None

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": self._usage(output_tokens)}

    def open(self) -> bytes:
        return (sse_named("message_start", {"type": "message_start", "message": self._message(
            [], (None, None), 0)}) + sse_named("ping", {"type": "ping"}))

    def chunk(self, delta: CompletionOutput) -> bytes:
        final = delta.finish_reason is not None
        out = b"".join(self._event(e) for e in self.answer.feed(delta.text, final))
        if final:
            stop = self._stop(self.answer.num_calls)
            out += sse_named("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                "usage": {"output_tokens": sum(self.call.num_generated)}})
        return out

    def _event(self, event: Event) -> bytes:
        what, block, text = event
        if what == "start":
            return sse_named("content_block_start", {
                "type": "content_block_start", "index": block.index,
                "content_block": ({"type": "text", "text": ""} if block.kind == "text" else
                                  {"type": "tool_use", "id": block.call_id, "name": block.name,
                                   "input": {}})})
        if what == "stop":
            return sse_named("content_block_stop", {"type": "content_block_stop",
                                                    "index": block.index})
        delta = ({"type": "text_delta", "text": text} if block.kind == "text" else
                 {"type": "input_json_delta", "partial_json": text})
        return sse_named("content_block_delta", {"type": "content_block_delta",
                                                 "index": block.index, "delta": delta})

    def close(self) -> bytes:
        return sse_named("message_stop", {"type": "message_stop"})

    def error(self, error: APIError) -> bytes:
        return sse_named("error", error.anthropic_body())

    def final(self) -> dict[str, Any]:
        fmt = self.call.tool_format if self.call.tools is not None else None
        blocks = whole(fmt, self.call.texts.get(0, []))
        num_calls = sum(b.kind == "call" for b in blocks)
        return self._message([_content(b) for b in blocks], self._stop(num_calls),
                             sum(self.call.num_generated))


def _content(block: Block) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name,
            "input": arguments_object(block.text)}


def arguments_object(text: str) -> Any:
    """A call's arguments as an object; a call cut by max_tokens (not valid JSON yet) keeps
    its text under "_partial" (its stop_reason says max_tokens)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {"_partial": text}
    return value

"""OpenAI's Responses answer: a `response` object, or its stream of named SSE events
(response.created, .in_progress, .output_item.added, .content_part.added, .output_text.delta /
.done, .function_call_arguments.delta / .done, .output_item.done, then .completed or
.incomplete). Output items come from service.answer_blocks, so streamed and whole answers
hold the same items; a stored response keeps the conversation for `previous_response_id`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvcore.request import CompletionOutput
from kvcore.service.answer_blocks import AnswerBlocks, Block, Event, whole
from kvcore.service.call import Call
from kvcore.service.errors import APIError
from kvcore.service.responses_protocol import ResponsesRequest
from kvcore.service.streaming import sse_named

ECHOED = ("instructions", "max_output_tokens", "metadata", "previous_response_id", "temperature",
          "top_p", "user", "tool_choice", "tools", "parallel_tool_calls")


class ResponsesFormat:
    content_type = "text/event-stream"
    streams_only = False

    def __init__(self, call: Call, model: str, request: ResponsesRequest,
                 store: Callable[[dict[str, Any], list[dict[str, Any]]], None]) -> None:
        self.call, self.model, self.request, self._store = call, model, request, store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.answer = AnswerBlocks(call.tool_format if call.tools is not None else None)
        self.sequence = 0
        self.item_ids: dict[int, str] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_named(kind, payload)

    def _response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.request.body
        usage = self.call.usage()
        response: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": None, "model": self.model, "output": output,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": self.request.store, "truncation": "disabled",
            **{k: body.get(k) for k in ECHOED}}
        response["tools"] = response["tools"] or []
        response["tool_choice"] = response["tool_choice"] or "auto"
        response["parallel_tool_calls"] = response["parallel_tool_calls"] is not False
        response["metadata"] = response["metadata"] or {}
        if status != "in_progress":
            response["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}
        return response

    def _status(self) -> str:
        return "incomplete" if self.call.finish_reasons.get(0) == "length" else "completed"

    def _item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = self.item_ids.setdefault(block.index, (
            "msg_" if block.kind == "text" else "fc_") + uuid.uuid4().hex[:24])
        if block.kind == "text":
            text = block.text if status != "in_progress" else ""
            return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                    "content": [] if status == "in_progress" else [_text_part(text)]}
        return {"id": item_id, "type": "function_call", "call_id": block.call_id,
                "name": block.name, "status": status,
                "arguments": block.text if status != "in_progress" else ""}

    def open(self) -> bytes:
        start = self._response("in_progress", [])
        return (self._event("response.created", response=start)
                + self._event("response.in_progress", response=start))

    def chunk(self, delta: CompletionOutput) -> bytes:
        final = delta.finish_reason is not None
        return b"".join(self._item_event(e) for e in self.answer.feed(delta.text, final))

    def _item_event(self, event: Event) -> bytes:
        what, block, text = event
        at = {"output_index": block.index}
        item = self._item(block, "in_progress")
        where = {"item_id": item["id"], **at}
        if what == "start":
            out = self._event("response.output_item.added", item=item, **at)
            if block.kind == "text":
                out += self._event("response.content_part.added", content_index=0,
                                   part=_text_part(""), **where)
            return out
        if what == "delta":
            if block.kind == "text":
                return self._event("response.output_text.delta", content_index=0, delta=text,
                                   logprobs=[], **where)
            return self._event("response.function_call_arguments.delta", delta=text, **where)
        done = self._item(block, self._status())
        if block.kind == "text":
            out = (self._event("response.output_text.done", content_index=0, text=block.text,
                               logprobs=[], **where)
                   + self._event("response.content_part.done", content_index=0,
                                 part=_text_part(block.text), **where))
        else:
            out = self._event("response.function_call_arguments.done", name=block.name,
                              arguments=block.text, **where)
        return out + self._event("response.output_item.done", item=done, **at)

    def close(self) -> bytes:
        response = self._finish(self.answer.blocks)
        return self._event(f"response.{response['status']}", response=response)

    def error(self, error: APIError) -> bytes:
        return self._event("error", code=str(error.code), message=error.message,
                           param=error.param)

    def final(self) -> dict[str, Any]:
        fmt = self.call.tool_format if self.call.tools is not None else None
        return self._finish(whole(fmt, self.call.texts.get(0, [])))

    def _finish(self, blocks: list[Block]) -> dict[str, Any]:
        """The finished Response (stored when asked: its conversation continues it)."""
        status = self._status()
        if not blocks:  # an empty answer is still a message
            blocks = [Block("text", 0)]
        response = self._response(status, [self._item(b, status) for b in blocks])
        if self.request.store:
            self._store(response, [*self.request.history, *self.request.new,
                                   _as_chat(blocks)])
        return response


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _as_chat(blocks: list[Block]) -> dict[str, Any]:
    """The answer as the chat message a follow-up's prompt renders."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(
        b.text for b in blocks if b.kind == "text")}
    calls = [{"id": b.call_id, "type": "function",
              "function": {"name": b.name, "arguments": b.text}} for b in blocks
             if b.kind == "call" and _is_json(b.text)]  # a call cut by length is not replayed
    if calls:
        message["tool_calls"] = calls
    return message

"""The wire formats of a Call's answer: OpenAI's chat and completions objects (SSE chunks and the
whole response) and msgpack frames. A format keeps only what its wire needs (whose first chunk
went out, completions' logprob offsets, each choice's tool-call parser); the text, tokens and
finish of every choice come from the Call's deltas. A new protocol is a parser to a Call and a
class with these methods (service.openai_routes.respond runs any of them)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from kvcore.model.tokenizer import Tokenizer
from kvcore.request import CompletionOutput
from kvcore.sampling.params import TokenLogprob
from kvcore.service.call import Call
from kvcore.service.errors import APIError
from kvcore.service.streaming import MSGPACK_TYPE, SSE_DONE, msgpack_frame, sse_event
from kvcore.service.tool_format import CallStream

# JSON has no -inf; OpenAI-compatible servers report impossible tokens at this floor (as vLLM does)
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN and -inf


class WireFormat(Protocol):
    content_type: str
    streams_only: bool  # answers in chunks even when the call does not ask to stream

    def open(self) -> bytes: ...  # the stream's first bytes

    def chunk(self, delta: CompletionOutput) -> bytes: ...  # one choice's delta

    def close(self) -> bytes: ...  # the stream's last bytes

    def error(self, error: APIError) -> bytes: ...  # an error after the stream's headers

    def final(self) -> dict[str, Any]: ...  # the whole answer (the call's deltas all taken)


class MsgpackFrames:
    """`{"index", "token_ids", "text", "finish_reason"}` frames, one per delta."""

    content_type = MSGPACK_TYPE
    streams_only = True

    def __init__(self, call: Call) -> None:
        self.call = call

    def open(self) -> bytes:
        return b""

    def chunk(self, delta: CompletionOutput) -> bytes:
        return msgpack_frame({"index": delta.index, "token_ids": delta.token_ids,
                              "text": delta.text, "finish_reason": delta.finish_reason})

    def close(self) -> bytes:
        return b""

    def error(self, error: APIError) -> bytes:
        return msgpack_frame(error.body())

    def final(self) -> dict[str, Any]:
        raise AssertionError("msgpack answers are always frames")


class OpenAIFormat:
    """chat.completion(.chunk) and text_completion objects of one call."""

    content_type = "text/event-stream"
    streams_only = False

    def __init__(self, call: Call, model: str, tokenizer: Tokenizer) -> None:
        self.call, self.model, self.tokenizer = call, model, tokenizer
        self.n = call.n
        self.created = int(time.time())
        self.token_texts: dict[int, str] = {}
        self.chat = call.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.started: set[int] = set()  # choices whose first chunk (role, echo) went out
        self.offsets: dict[int, int] = {}  # completions logprobs: characters before the next
        self.tool_streams: dict[int, CallStream] = {}

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        suffix = ".chunk" if chunk and self.chat else ""
        return {"id": self.call.call_id, "object": self.object + suffix,
                "created": self.created, "model": self.model, "choices": choices}

    def _echo(self, index: int) -> str:
        if not self.call.echo:
            return ""
        if self.chat:  # vLLM: the reply starts with the last message when it is the assistant's
            last = self.call.messages[-1]
            return str(last["content"]) if last["role"] == "assistant" else ""
        prompt = self.call.prompts[index // self.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(
            prompt, skip_special_tokens=False)

    def _token(self, token_id: int) -> str:
        # each token decoded on its own, as vLLM reports them (" Hello", not "ĠHello")
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def _logprobs(self, index: int, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        """Chat's {content: [{token, logprob, bytes, top_logprobs}]}, or completions'
        {tokens, token_logprobs, top_logprobs, text_offset}; None when not asked for."""
        if self.call.params.logprobs is None:
            return None
        if self.chat:
            return {"content": [{
                "token": (text := self._token(e.token_id)), "logprob": _lp(e.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token(token_id)), "logprob": _lp(value),
                                  "bytes": list(t.encode())} for token_id, value in e.top],
            } for e in logprobs]}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self.offsets.get(index, 0)
        for e in logprobs:
            text = self._token(e.token_id)
            tokens.append(text)
            token_logprobs.append(_lp(e.logprob))
            # vLLM's top_logprobs hold the sampled token next to the top k
            top = {text: _lp(e.logprob)}
            for token_id, value in e.top:
                top.setdefault(self._token(token_id), _lp(value))
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def _content(self, index: int, text: str, finish_reason: str | None, final: bool
                 ) -> tuple[dict[str, Any], str | None]:
        """A chat choice's content (and tool calls), and its finish reason ("tool_calls" for
        an answer that made calls)."""
        content: dict[str, Any] = {"content": text}
        if self.call.tools is None:
            return content, finish_reason
        fmt = self.call.tool_format
        if final:
            text_or_none, calls = fmt.parse(text)
            content, num_calls = {"content": text_or_none}, len(calls)
        else:
            stream = self.tool_streams.setdefault(index, fmt.stream())
            text, calls = stream.feed(text, finish_reason is not None)
            content, num_calls = ({"content": text} if text else {}), stream.num_calls
        if calls:
            content["tool_calls"] = calls
        return content, "tool_calls" if finish_reason == "stop" and num_calls else finish_reason

    def open(self) -> bytes:
        """Chat streams open every choice with its role (vLLM and OpenAI do)."""
        if not self.chat:
            return b""
        events = []
        for index in range(len(self.call.prompt_ids) * self.n):
            self.started.add(index)
            delta = {"role": "assistant", "content": self._echo(index)}
            events.append(sse_event(self._envelope(
                [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                True)))
        return b"".join(events)

    def chunk(self, delta: CompletionOutput) -> bytes:
        index, text, finish_reason = delta.index, delta.text, delta.finish_reason
        if index not in self.started:
            self.started.add(index)
            text = self._echo(index) + text
        entry: dict[str, Any] = {"index": index}
        if self.chat:
            content, finish_reason = self._content(index, text, finish_reason, False)
            if self.call.tools is None and not text and finish_reason is not None:
                content = {}
            if not content and finish_reason is None and not delta.logprobs:
                return b""  # nothing new (a tool call's held-back text): no empty chunk
            entry["delta"] = content
        else:
            entry["text"] = text
        entry["logprobs"] = self._logprobs(index, delta.logprobs or [])
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = delta.stop_reason if delta.finish_reason else None
        return sse_event(self._envelope([entry], True))

    def close(self) -> bytes:
        usage = (sse_event(self._envelope([], True) | {"usage": self.call.usage()})
                 if self.call.include_usage else b"")
        return usage + SSE_DONE

    def error(self, error: APIError) -> bytes:
        return sse_event(error.body()) + SSE_DONE

    def final(self) -> dict[str, Any]:
        """The whole answer, from the Call's text and logprobs of each choice."""
        call = self.call
        choices = []
        for index in range(len(call.prompt_ids) * self.n):
            if index not in call.finish_reasons:
                continue  # a beam search that found fewer hypotheses than beams
            text = self._echo(index) + "".join(call.texts.get(index, ()))
            entry: dict[str, Any] = {"index": index}
            finish_reason: str | None = call.finish_reasons[index]
            if self.chat:
                content, finish_reason = self._content(index, text, finish_reason, True)
                entry["message"] = {"role": "assistant", **content}
            else:
                entry["text"] = text
            entry["logprobs"] = self._logprobs(index, call.choice_logprobs.get(index, []))
            entry["finish_reason"] = finish_reason
            entry["stop_reason"] = call.stop_reasons[index]
            choices.append(entry)
        return self._envelope(choices, False) | {"usage": call.usage()}

"""The OpenAI objects of one call, formatted from the engine's outputs: stream chunks, msgpack
frames and the final response. The text and tokens of a choice live in the engine's output
records; this keeps only what the wire needs: which choices have finished (and how), whose
first chunk went out, completions' logprob offsets and the tool-call parser of each choice."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from kvcore.model.tokenizer import Tokenizer
from kvcore.request import CompletionOutput, RequestOutput
from kvcore.sampling.params import BeamSearchParams, TokenLogprob
from kvcore.service.generation import Generation, Job
from kvcore.service.protocol import Call
from kvcore.service.streaming import msgpack_frame, sse_event
from kvcore.service.tool_format import FORMATS, CallStream

# (choice index, new text, new token ids, new logprobs, the choice's output)
Delta = tuple[int, str, list[int], list[TokenLogprob], CompletionOutput]
# JSON has no -inf; OpenAI-compatible servers report impossible tokens at this floor (as vLLM does)
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN and -inf


class Formatter:
    def __init__(self, call: Call, gen: Generation, call_id: str, model: str,
                 tokenizer: Tokenizer) -> None:
        self.call, self.gen, self.call_id, self.model = call, gen, call_id, model
        self.n = call.n
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}
        self.chat = call.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.finish_reasons: dict[int, str] = {}  # choice index -> the reason sent
        self.started: set[int] = set()  # choices whose first chunk (role, echo) went out
        self.offsets: dict[int, int] = {}  # completions logprobs: characters before the next
        self.tool_streams: dict[int, CallStream] = {}

    def deltas(self, job: Job, output: RequestOutput) -> Iterator[Delta]:
        """What is new for each choice of an engine output; a choice once, until it finishes.
        Beams reorder while they run: only their final ranking is an answer."""
        beam = isinstance(job.params, BeamSearchParams)
        if beam and not output.finished:
            return
        for position, c in enumerate(output.outputs[:self.n]):
            index = job.index * self.n + (position if beam else c.index)
            if index in self.finish_reasons:
                continue  # the final output repeats every choice
            if c.finish_reason is not None:
                self.finish_reasons[index] = c.finish_reason
            if beam:
                yield index, c.text, c.token_ids, [], c
            elif c.delta_text or c.delta_token_ids or c.finish_reason is not None:
                yield index, c.delta_text, c.delta_token_ids, c.delta_logprobs or [], c

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        suffix = ".chunk" if chunk and self.chat else ""
        return {"id": self.call_id, "object": self.object + suffix, "created": self.created,
                "model": self.model, "choices": choices}

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
        if self.call.logprobs is None:
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
        fmt = FORMATS[self.call.tools.format]
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

    def role_chunks(self) -> bytes:
        """Chat streams open every choice with its role (vLLM and OpenAI do)."""
        events = []
        for index in range(len(self.gen.jobs) * self.n):
            self.started.add(index)
            delta = {"role": "assistant", "content": self._echo(index)}
            events.append(sse_event(self._envelope(
                [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}],
                True)))
        return b"".join(events)

    def chunk(self, delta: Delta, binary: bool) -> bytes:
        index, text, token_ids, logprobs, c = delta
        if binary:
            return msgpack_frame({"index": index, "token_ids": token_ids, "text": text,
                                  "finish_reason": c.finish_reason})
        if index not in self.started:
            self.started.add(index)
            text = self._echo(index) + text
        entry: dict[str, Any] = {"index": index}
        finish_reason = c.finish_reason
        if self.chat:
            content, finish_reason = self._content(index, text, finish_reason, False)
            if self.call.tools is None and not text and finish_reason is not None:
                content = {}
            entry["delta"] = content
        else:
            entry["text"] = text
        entry["logprobs"] = self._logprobs(index, logprobs)
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = c.stop_reason if c.finish_reason else None
        return sse_event(self._envelope([entry], True))

    def usage_chunk(self) -> bytes:
        return sse_event(self._envelope([], True) | {"usage": self.gen.usage()})

    def final(self) -> dict[str, Any]:
        """The whole answer, from each request's final output (its cumulative fields)."""
        choices = []
        for job in self.gen.jobs:
            assert job.last_output is not None and job.last_output.finished
            for position, c in enumerate(job.last_output.outputs[:self.n]):
                index = job.index * self.n + position
                text = self._echo(index) + c.text
                entry: dict[str, Any] = {"index": index}
                finish_reason = c.finish_reason
                if self.chat:
                    content, finish_reason = self._content(index, text, finish_reason, True)
                    entry["message"] = {"role": "assistant", **content}
                else:
                    entry["text"] = text
                entry["logprobs"] = self._logprobs(index, c.logprobs or [])
                entry["finish_reason"] = finish_reason
                entry["stop_reason"] = c.stop_reason
                choices.append(entry)
        return self._envelope(choices, False) | {"usage": self.gen.usage()}

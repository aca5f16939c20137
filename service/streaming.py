"""Wire framing: SSE events as OpenAI/vLLM send them, and length-prefixed msgpack frames."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack

from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling.params import TokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
MSGPACK_TYPE = "application/x-msgpack"
# JSON has no -inf; OpenAI-compatible servers report impossible tokens at this floor (as vLLM does)
LOGPROB_FLOOR = -9999.0


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def msgpack_frame(payload: dict[str, Any]) -> bytes:
    """One frame: a 4-byte big-endian length, then that many bytes of one msgpack map."""
    body = msgpack.packb(payload, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _lp(value: float) -> float:
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR  # also maps NaN and -inf


class LogprobFormatter:
    """Turns TokenLogprob records into OpenAI's completions and chat logprob shapes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        # each token decoded on its own, as vLLM reports them (" Hello", not "ĠHello")
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def completion(self, logprobs: list[TokenLogprob], text_offset: int) -> tuple[dict[str, Any],
                                                                                  int]:
        """{tokens, token_logprobs, top_logprobs, text_offset}; returns it and the next offset."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for entry in logprobs:
            text = self.token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(_lp(entry.logprob))
            # vLLM's top_logprobs hold the sampled token next to the top k
            top = {text: _lp(entry.logprob)}
            for token_id, value in entry.top:
                top.setdefault(self.token_text(token_id), _lp(value))
            tops.append(top)
            offsets.append(text_offset)
            text_offset += len(text)
        return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                 "text_offset": offsets}, text_offset)

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
        content = []
        for entry in logprobs:
            text = self.token_text(entry.token_id)
            content.append({
                "token": text, "logprob": _lp(entry.logprob), "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t := self.token_text(token_id)), "logprob": _lp(value),
                     "bytes": list(t.encode())}
                    for token_id, value in entry.top],
            })
        return {"content": content}

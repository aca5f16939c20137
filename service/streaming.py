"""Wire framing: SSE events as OpenAI/vLLM send them, and length-prefixed msgpack frames."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack

SSE_DONE = b"data: [DONE]\n\n"
MSGPACK_TYPE = "application/x-msgpack"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_named(event: str, payload: dict[str, Any]) -> bytes:
    """An SSE event with its `event:` line (the Responses and Messages APIs name each event)."""
    return (f"event: {event}\ndata: ".encode() + json.dumps(payload, separators=(",", ":")).encode()
            + b"\n\n")


def msgpack_frame(payload: dict[str, Any]) -> bytes:
    """One frame: a 4-byte big-endian length, then that many bytes of one msgpack map."""
    body = msgpack.packb(payload, use_bin_type=True)
    return struct.pack(">I", len(body)) + body

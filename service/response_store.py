"""Stored Responses (`store: true`) per tenant, bounded in count, bytes and age: what GET
/v1/responses/{id} answers and what `previous_response_id` continues. Only the response object
and the conversation's messages are kept (plain data, never KV blocks: a follow-up's prompt
starts with the stored conversation, so its prefix is a prefix-cache hit while its blocks stay
cached, and recomputed otherwise)."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 4096  # all tenants
MAX_BYTES = 256 << 20  # all tenants; a tenant may hold at most half
MAX_AGE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Stored:
    tenant: str
    created: float  # time.monotonic()
    response: dict[str, Any]  # the Response object as answered
    conversation: list[dict[str, Any]]  # chat messages, the answer included; no instructions
    num_bytes: int


class ResponseStore:
    """Oldest first out: past the count or the bytes, a tenant over its half loses its oldest,
    else the oldest of all goes; an entry older than `max_age_s` is never found."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES,
                 max_age_s: float = MAX_AGE_S) -> None:
        self.max_responses, self.max_bytes, self.max_age_s = max_responses, max_bytes, max_age_s
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._bytes: dict[str, int] = {}  # per tenant
        self._count: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response: dict[str, Any],
            conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        if size > self.max_bytes // 2:
            return  # larger than a tenant's share: not kept (a follow-up gets a 404)
        entry = Stored(tenant, time.monotonic(), response, conversation, size)
        self._entries[response["id"]] = entry
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        self._count[tenant] = self._count.get(tenant, 0) + 1
        self._expire()
        while (self._bytes[tenant] > self.max_bytes // 2
               or self._count[tenant] > self.max_responses // 2):
            self._drop(next(k for k, e in self._entries.items() if e.tenant == tenant))
        while len(self._entries) > self.max_responses or sum(
                self._bytes.values()) > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The tenant's stored response, or None (unknown, expired, or another tenant's)."""
        self._expire()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, tenant: str, response_id: str) -> bool:
        if self.get(tenant, response_id) is None:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        deadline = time.monotonic() - self.max_age_s
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.created >= deadline:
                break
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id)
        self._bytes[entry.tenant] -= entry.num_bytes
        self._count[entry.tenant] -= 1
        if not self._count[entry.tenant]:
            del self._bytes[entry.tenant], self._count[entry.tenant]

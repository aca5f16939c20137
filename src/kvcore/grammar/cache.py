"""Compiled constraints kept for reuse, bounded in bytes, with a share per tenant.

An entry's size is what its compile worker measured: the C heap the compiled grammar held
after its first token mask (glibc's mallinfo2 before and after, in a process doing nothing
else). Matching may later grow its lexer by up to MAX_LEXER_STATES states (1-2 KB each),
shared by the template and its copies.

Eviction: a tenant holds at most `tenant_share` of `max_bytes` (its own least recently used
entry goes first); past `max_bytes` the least recently used entry of the tenant holding the
most goes, so one tenant's stream of unique schemas evicts its own entries, not others'. An
entry a running request still holds (a Compiled object it references) stays findable until
released: `get` finds it through a weak reference, so a request never compiles twice."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

CACHE_BYTES = 128 << 20  # compiled constraints kept for reuse
TENANT_SHARE = 0.5  # of CACHE_BYTES, at most, per tenant


class Compiled:
    """One compiled constraint: the template matcher each sequence copies."""

    __slots__ = ("key", "template", "num_bytes", "tenant", "__weakref__")

    def __init__(self, key: Hashable, template: Any, num_bytes: int, tenant: str) -> None:
        self.key = key
        self.template = template
        self.num_bytes = num_bytes
        self.tenant = tenant


class CompiledCache:
    """Thread-safe."""

    def __init__(self, max_bytes: int = CACHE_BYTES, tenant_share: float = TENANT_SHARE) -> None:
        if max_bytes < 0 or not 0 < tenant_share <= 1:
            raise ValueError(f"max_bytes must be >= 0 and tenant_share in (0, 1], got "
                             f"{max_bytes}, {tenant_share}")
        self.max_bytes = max_bytes
        self.tenant_bytes_cap = int(max_bytes * tenant_share)
        self.num_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[Hashable, Compiled] = OrderedDict()  # LRU order
        self._by_tenant: dict[str, OrderedDict[Hashable, Compiled]] = {}
        self._live: weakref.WeakValueDictionary[Hashable, Compiled] = (
            weakref.WeakValueDictionary())
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_bytes(self, tenant: str) -> int:
        with self._lock:
            return sum(e.num_bytes for e in self._by_tenant.get(tenant, {}).values())

    def get(self, key: Hashable) -> Compiled | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self._by_tenant[entry.tenant].move_to_end(key)
                return entry
            return self._live.get(key)

    def put(self, entry: Compiled) -> None:
        """Keep `entry` (it stays findable while referenced, even when too large to keep)."""
        with self._lock:
            self._live[entry.key] = entry
            if entry.key in self._entries or entry.num_bytes > self.tenant_bytes_cap:
                return
            own = self._by_tenant.get(entry.tenant, OrderedDict())
            own_bytes = sum(e.num_bytes for e in own.values())
            while own and own_bytes + entry.num_bytes > self.tenant_bytes_cap:
                own_bytes -= self._evict(next(iter(own.values())))
            while self._entries and self.num_bytes + entry.num_bytes > self.max_bytes:
                largest = max(self._by_tenant.values(),
                              key=lambda es: sum(e.num_bytes for e in es.values()))
                self._evict(next(iter(largest.values())))
            self._entries[entry.key] = entry
            self._by_tenant.setdefault(entry.tenant, OrderedDict())[entry.key] = entry
            self.num_bytes += entry.num_bytes

    def _evict(self, entry: Compiled) -> int:
        del self._entries[entry.key]
        own = self._by_tenant[entry.tenant]
        del own[entry.key]
        if not own:
            del self._by_tenant[entry.tenant]
        self.num_bytes -= entry.num_bytes
        self.num_evictions += 1
        return entry.num_bytes

"""The router's index: chain hash -> replicas holding the block, fed by their cache events."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvcore.cache import BlockHash, CacheEvent

DEFAULT_MAX_ENTRIES = 200_000  # chain hashes; about 250 bytes each with their replica set: ~50 MB


class ChainIndex:
    """Which replica holds which cached block, by the pool's own chain hashes.

    Memory is bounded: at most `max_entries` hashes, least recently stored-or-matched first out.
    Forgetting an entry only costs affinity (the router underestimates a replica's hits); it can
    never route wrongly for correctness, because a replica confirms every hit by its token ids.
    Thread-safe: Ray Serve runs request routers on their own event loop thread while events are
    applied on the ingress's loop.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive integer, got {max_entries!r}")
        self.max_entries = max_entries
        self._holders: OrderedDict[BlockHash, set[str]] = OrderedDict()  # LRU order, oldest first
        self._counts: dict[str, int] = {}  # replica -> entries naming it
        self._lock = threading.Lock()
        self.num_evicted = 0  # entries dropped by the LRU bound (a gauge of index pressure)

    def __len__(self) -> int:
        return len(self._holders)

    def apply(self, replica_id: str, events: Iterable[CacheEvent]) -> None:
        """Apply one replica's cache changes in order: (True, hash) cached, (False, hash) gone."""
        holders = self._holders
        with self._lock:
            count = self._counts.get(replica_id, 0)
            for stored, block_hash in events:
                replicas = holders.get(block_hash)
                if stored:
                    if replicas is None:
                        holders[block_hash] = {replica_id}
                        count += 1
                    else:
                        if replica_id not in replicas:
                            replicas.add(replica_id)
                            count += 1
                        holders.move_to_end(block_hash)
                elif replicas is not None and replica_id in replicas:
                    replicas.remove(replica_id)
                    count -= 1
                    if not replicas:
                        del holders[block_hash]
            self._counts[replica_id] = count
            while len(holders) > self.max_entries:
                _, evicted = holders.popitem(last=False)
                for other in evicted:
                    self._counts[other] -= 1
                self.num_evicted += 1

    def drop_replica(self, replica_id: str) -> int:
        """Forget everything a replica held (it died, or restarted with an empty cache).
        Returns how many entries named it. O(entries)."""
        num = 0
        with self._lock:
            for block_hash in list(self._holders):
                replicas = self._holders[block_hash]
                if replica_id in replicas:
                    num += 1
                    replicas.discard(replica_id)
                    if not replicas:
                        del self._holders[block_hash]
            self._counts.pop(replica_id, None)
        return num

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For each replica holding the first block: how many leading blocks of the chain it holds.
        A block is useless without every block before it, so the walk stops per replica at its
        first gap. Matched entries become most recently used."""
        out: dict[str, int] = {}
        with self._lock:
            holders = self._holders
            alive: set[str] | None = None
            for depth, block_hash in enumerate(block_hashes):
                replicas = holders.get(block_hash)
                if not replicas:
                    break
                holders.move_to_end(block_hash)
                alive = set(replicas) if alive is None else alive & replicas
                if not alive:
                    break
                for replica_id in alive:
                    out[replica_id] = depth + 1
        return out

    def num_blocks(self, replica_id: str) -> int:
        """Entries naming the replica: its cached blocks as far as the index knows."""
        with self._lock:
            return self._counts.get(replica_id, 0)

    def replicas(self) -> set[str]:
        """Every replica named by at least one entry (for tests and metrics)."""
        with self._lock:
            return set().union(*self._holders.values()) if self._holders else set()

"""TierStore: the tiers behind the pool, in order (host memory, then disk), their background
writers and their loader.

Writes never block a step: a batch of pages is queued to each tier's writer thread while that
queue holds less than its byte budget, else dropped (counted). Loads run on the loader thread
into a host buffer (pinned on a GPU), page after page of a chain, each from the first tier that
holds it; the first page that cannot be read ends the chain (its tokens are recomputed).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from kvcore.cache.block_pool import BlockHash
from kvcore.cache.tiers.disk import DiskTier
from kvcore.cache.tiers.host import HostTier
from kvcore.cache.tiers.layout import Gathered
from kvcore.cache.tiers.stats import TierCounters, TierStats

log = structlog.get_logger(__name__)
Tier = HostTier | DiskTier
PageKey = tuple[BlockHash, bytes]  # (chain hash, token ids packed as int64)
DEFAULT_QUEUE_BYTES = 256 * 2**20  # pages waiting for one tier's writer, at most


@dataclass(slots=True)
class LoadJob:
    """Pages to read into `pages` (n, page_bytes); `done` is set when the loader is through.
    num_loaded: the leading pages read (the rest must be recomputed); tiers: where each of
    them came from."""

    keys: list[PageKey]
    pages: np.ndarray
    done: threading.Event = field(default_factory=threading.Event)
    num_loaded: int = 0
    tiers: list[str] = field(default_factory=list)
    seconds: float = 0.0


class _Writer:
    """One tier's background writer: a queue bounded in bytes, one thread."""

    def __init__(self, tier: Tier, counters: TierCounters, max_bytes: int,
                 done: Callable[[list[PageKey]], None]) -> None:
        self.tier = tier
        self.done = done  # told when a batch was written (or failed)
        self.counters = counters
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[list[PageKey], Gathered] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"kvcore-tier-{tier.name}",
                                       daemon=True)
        self.thread.start()

    def offer(self, keys: list[PageKey], gathered: Gathered, nbytes: int) -> None:
        with self._lock:
            self.queued_bytes += nbytes
        self._queue.put((keys, gathered))

    def room(self, nbytes: int) -> bool:
        return self.queued_bytes + nbytes <= self.max_bytes

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            keys, gathered = job
            start = time.perf_counter()
            try:
                pages = gathered.wait()
                written = self.tier.put(keys, pages)
                self.counters.add(self.counters.stores, self.tier.name, written)
                self.counters.store_seconds.observe(time.perf_counter() - start)
            except Exception:  # a bug here must not stop later writes
                log.exception("kv tier write failed", tier=self.tier.name)
            finally:
                with self._lock:
                    self.queued_bytes -= len(keys) * gathered.pages.shape[1]
                self.done(keys)
                self._queue.task_done()

    def flush(self, deadline: float) -> bool:
        """Wait until every queued write landed (False: the deadline came first)."""
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline or not self.thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self.thread.join(timeout)


class TierStore:
    """The tiers in lookup order and their threads. `buffer(num_pages)` gives the host memory
    a load reads into (PageCopier.host_buffer: pinned on a GPU)."""

    def __init__(self, tiers: Sequence[Tier], page_bytes: int,
                 buffer: Callable[[int], np.ndarray],
                 max_queued_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if not tiers:
            raise ValueError("a TierStore needs at least one tier")
        self.tiers = list(tiers)
        self.page_bytes = page_bytes
        self._buffer = buffer
        self.counters = TierCounters()
        # pages queued and not written yet, by how many writers still hold them: not wanted
        # again meanwhile (a block written through, then evicted before the write landed)
        self._queued: dict[BlockHash, int] = {}
        self._queued_lock = threading.Lock()
        self._writers = [_Writer(t, self.counters, max(max_queued_bytes, page_bytes),
                                 self._written) for t in self.tiers]
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._loader = threading.Thread(target=self._run_loads, name="kvcore-tier-loader",
                                        daemon=True)
        self._loader.start()
        self._closed = False
        atexit.register(self.close)  # queued writes land before the interpreter exits

    # --- lookups (the engine step) ---

    def find(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The tier holding each of the leading hashes, up to the first that none holds."""
        found: list[str] = []
        for block_hash in hashes:
            tier = self.tier_of(block_hash)
            if tier is None:
                break
            found.append(tier)
        return found

    def tier_of(self, block_hash: BlockHash) -> str | None:
        for tier in self.tiers:
            if block_hash in tier:
                return tier.name
        return None

    def bandwidth(self, tier: str) -> float:
        """Measured bytes per second of loads from a tier."""
        return self.counters.bandwidth[tier]

    # --- writes (the engine step queues, the writers write) ---

    def wants(self, block_hash: BlockHash) -> bool:
        """Some tier lacks the page (and takes writes), and no write of it is queued."""
        return block_hash not in self._queued and any(
            t.enabled and block_hash not in t for t in self.tiers)

    def _written(self, keys: list[PageKey]) -> None:
        with self._queued_lock:
            for block_hash, _ in keys:
                left = self._queued.get(block_hash, 0) - 1
                if left > 0:
                    self._queued[block_hash] = left
                else:
                    self._queued.pop(block_hash, None)

    def room(self, num_pages: int) -> bool:
        """Some writer's queue takes num_pages more pages now."""
        nbytes = num_pages * self.page_bytes
        return any(w.room(nbytes) for w in self._writers)

    def store(self, keys: list[PageKey], gathered: Gathered) -> None:
        """Queue pages to every tier whose writer has room; the others drop them."""
        nbytes = len(keys) * self.page_bytes
        for writer in self._writers:
            if not writer.tier.enabled:
                continue
            if writer.room(nbytes):
                with self._queued_lock:
                    for block_hash, _ in keys:
                        self._queued[block_hash] = self._queued.get(block_hash, 0) + 1
                writer.offer(keys, gathered, nbytes)
            else:
                self.counters.add(self.counters.dropped, writer.tier.name, len(keys))

    def drop(self, num_pages: int) -> None:
        """Pages the engine did not even gather, every queue being full."""
        for writer in self._writers:
            self.counters.add(self.counters.dropped, writer.tier.name, num_pages)

    # --- loads (the engine step starts them, the loader reads) ---

    def load(self, keys: list[PageKey]) -> LoadJob:
        job = LoadJob(keys, self._buffer(len(keys)))
        self._loads.put(job)
        return job

    def _run_loads(self) -> None:
        while True:
            job = self._loads.get()
            if job is None:
                return
            start = time.perf_counter()
            try:
                self._read(job)
            except Exception:
                log.exception("kv tier load failed")
            job.seconds = time.perf_counter() - start
            counters = self.counters
            counters.load_seconds.observe(job.seconds)
            counters.load_failures += len(job.keys) - job.num_loaded
            job.done.set()

    def _read(self, job: LoadJob) -> None:
        spent: dict[str, float] = {}
        for i, (block_hash, token_bytes) in enumerate(job.keys):
            for tier in self.tiers:
                start = time.perf_counter()
                if tier.get(block_hash, token_bytes, job.pages[i]):
                    spent[tier.name] = spent.get(tier.name, 0.0) + time.perf_counter() - start
                    job.tiers.append(tier.name)
                    break
            else:
                return  # the chain ends here: the rest is recomputed
            job.num_loaded = i + 1
        for name, seconds in spent.items():
            num = job.tiers.count(name)
            self.counters.add(self.counters.hits, name, num)
            self.counters.measured(name, num * self.page_bytes, seconds)

    # --- the end ---

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write landed (False: not within timeout seconds)."""
        deadline = time.monotonic() + timeout
        return all(w.flush(deadline) for w in self._writers)

    def close(self, timeout: float = 30.0) -> None:
        """Let queued writes land (up to timeout seconds in all), then stop the threads."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        for writer in self._writers:
            writer.close(max(0.0, deadline - time.monotonic()))
        self._loads.put(None)
        self._loader.join(max(0.0, deadline - time.monotonic()))
        atexit.unregister(self.close)

    def stats(self, block_size: int) -> TierStats:
        c = self.counters
        return TierStats(
            hit_tokens={k: v * block_size for k, v in c.hits.items()},
            bytes={t.name: t.num_bytes for t in self.tiers},
            capacity_bytes={t.name: t.capacity_bytes for t in self.tiers},
            stores=dict(c.stores), dropped_writes=dict(c.dropped),
            load_failures=c.load_failures, load_seconds=c.load_seconds.snapshot(),
            store_seconds=c.store_seconds.snapshot())

    def occupancy(self) -> dict[str, dict[str, int | bool]]:
        """Per tier: pages and bytes held, capacity, queued write bytes (the KV inspector)."""
        return {t.name: {"pages": t.num_pages, "bytes": t.num_bytes,
                         "capacity_bytes": t.capacity_bytes, "queued_bytes": w.queued_bytes,
                         "enabled": t.enabled}
                for t, w in zip(self.tiers, self._writers, strict=True)}

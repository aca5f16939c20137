"""The KV inspector's data: a snapshot of the block pool, its requests and the planner's view, and
a 10-minute ring buffer of the pool's time series, built by AsyncEngine's driver between steps.

The snapshot is plain JSON-ready data. It never holds prompt or completion text, block hashes or
salts: request ids, counts and block ids only (the service adds tenant names).

Block map encoding (`blocks`, base64, one byte per block id):
    bits 0-1  state: 0 free, 1 cached (free but findable by hash: evictable), 2 used by one
              sequence, 3 shared (ref_count > 1; `shared` lists [block_id, ref_count])
    bit 2     the block's hash is in the prefix cache (cached blocks always; used ones when full)
    bits 3-7  cached blocks: LRU age bucket 0-31 in the free queue, 0 = evicted next
A request's block table is a list of runs [first_block_id, count]: count > 0 for ids
first, first + 1, ...; count < 0 for first, first - 1, ...; first None for blocks released by
the sliding window. Block i of a table holds min(block_size, num_slots - i * block_size) tokens.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcore.planner import plan_for_model
from kvcore.request import SequenceStatus

if TYPE_CHECKING:
    from kvcore.cache import KVCacheManager
    from kvcore.engine.engine import Engine
    from kvcore.scheduler import Scheduler

FREE, CACHED, USED, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "used", "shared")
IN_PREFIX_CACHE = 4  # bit 2
AGE_SHIFT = 3
NUM_AGE_BUCKETS = 32
SERIES_INTERVAL_S = 1.0  # one time-series sample per second ...
SERIES_LENGTH = 600  # ... for ten minutes
PUBLISH_INTERVAL_S = 0.5  # at most two snapshots a second ...
POLL_WINDOW_S = 5.0  # ... and only while someone asked for one this recently; a pool so large
MAX_BUILD_SHARE = 0.02  # that a build takes over 2% of the interval is published less often,
MAX_PUBLISH_INTERVAL_S = 1.0  # but still once a second
SERIES_NAMES = ("kv_usage", "prefix_hit_rate", "running", "waiting", "preemptions",
                "cow_copies", "tokens_per_s")


def encode_block_states(kv: KVCacheManager) -> tuple[bytes, dict[str, int], list[list[int]]]:
    """The block map (one byte per block, see the module docstring), the count per state and
    the [block_id, ref_count] pairs of shared blocks."""
    pool = kv.pool
    blocks = pool.blocks
    # two attribute reads per block are the whole Python cost; the rest is array arithmetic
    ref_counts = np.array([b.ref_count for b in blocks], np.int32)  # (num_blocks,)
    hashed = np.array([b.block_hash is not None for b in blocks], np.bool_)  # (num_blocks,)
    used = ref_counts > 0
    states = np.where(ref_counts > 1, SHARED, np.where(used, USED, FREE)).astype(np.uint8)
    states |= (hashed * IN_PREFIX_CACHE).astype(np.uint8)  # (num_blocks,) uint8
    cached = hashed & ~used
    num_cached = int(cached.sum())
    if num_cached:
        # a cached block's LRU age is its rank among the cached blocks of the free queue. Blocks
        # are freed to the tail, so walk from the tail and stop once every cached one is seen.
        order: list[int] = []
        block = pool.free_queue_tail()
        remaining = num_cached
        while remaining:
            assert block is not None
            if block.block_hash is not None:
                order.append(block.block_id)
                remaining -= 1
            block = block.prev_free
        ids = np.array(order[::-1], np.int64)  # (num_cached,) evicted next first
        ages = (np.arange(num_cached) * NUM_AGE_BUCKETS // num_cached).astype(np.uint8)
        states[ids] = CACHED | IN_PREFIX_CACHE | (ages << AGE_SHIFT)
    shared_ids = np.flatnonzero(ref_counts > 1)
    shared = [[int(i), int(ref_counts[i])] for i in shared_ids]
    num_used = int(used.sum())
    counts = {"free": pool.num_blocks - num_used - num_cached, "cached": num_cached,
              "used": num_used - len(shared), "shared": len(shared)}
    return states.tobytes(), counts, shared


_RELEASED = -(1 << 62)  # a released block in table_runs' arrays: no id is within 1 of it


def table_runs(table: Sequence[int | None]) -> list[list[int | None]]:
    """A block table as runs [first, count] (count < 0: descending ids; first None: released).

    Greedy from the left: a run takes the longest stretch of equal steps (+1, -1, or released
    after released) from its first block. Array work finds the stretches, so the Python loop runs
    once per run, not once per block."""
    n = len(table)
    if n < 64:  # below this the arrays' fixed cost is more than the loop's
        return _table_runs_loop(table)
    ids = np.fromiter((_RELEASED if b is None else b for b in table), np.int64, n)  # (n,)
    steps = np.diff(ids)  # (n - 1,)
    # for every step index, the last index of the stretch of equal steps it belongs to
    ends = np.append(np.flatnonzero(steps[1:] != steps[:-1]), n - 2)
    stretch_end = np.repeat(ends, np.diff(ends, prepend=-1)).tolist()
    step_list = steps.tolist()
    id_list = ids.tolist()
    runs: list[list[int | None]] = []
    pos = 0
    while pos < n:
        first = id_list[pos]
        released = first == _RELEASED
        step = step_list[pos] if pos < n - 1 else None
        if step == 0 if released else step in (1, -1):
            count = stretch_end[pos] - pos + 2
            runs.append([None, count] if released else [first, count if step == 1 else -count])
            pos += count
        else:
            runs.append([None if released else first, 1])
            pos += 1
    return runs


def _table_runs_loop(table: Sequence[int | None]) -> list[list[int | None]]:
    """table_runs, one block at a time."""
    runs: list[list[int | None]] = []
    for block_id in table:
        if runs:
            run = runs[-1]
            first, count = run[0], run[1]
            assert count is not None
            if first is None and block_id is None:
                run[1] = count + 1
                continue
            if first is not None and block_id is not None:
                last = first + count - 1 if count > 0 else first + count + 1
                if count == 1 and abs(block_id - first) == 1:
                    run[1] = 2 if block_id > first else -2
                    continue
                if count > 1 and block_id == last + 1:
                    run[1] = count + 1
                    continue
                if count < 0 and block_id == last - 1:
                    run[1] = count - 1
                    continue
        runs.append([block_id, 1])
    return runs


def _request_state(status: SequenceStatus, num_preemptions: int, num_computed: int,
                   num_tokens: int) -> str:
    if status is SequenceStatus.WAITING:
        return "preempted" if num_preemptions else "waiting"
    return "prefilling" if num_computed < num_tokens - 1 else "decoding"


def build_kv_snapshot(engine: Engine) -> dict[str, Any]:
    """The pool, the requests, the planner's view and the KV tiers' occupancy (None: no
    tier), as JSON-ready data (no series, no seq)."""
    tiers = None if engine.tiers is None else engine.tiers.snapshot()
    return pool_snapshot(engine.kv, engine.scheduler) | {"planner": planner_view(engine),
                                                         "tiers": tiers}


def pool_snapshot(kv: KVCacheManager, scheduler: Scheduler) -> dict[str, Any]:
    """The block map, its counts, the shared blocks and the requests with their block tables."""
    states, counts, shared = encode_block_states(kv)
    requests = []
    for request in [*scheduler.running, *scheduler.waiting]:  # sequences
        rid = request.seq_id
        held = rid in kv
        requests.append({
            "id": rid, "group": request.request_id, "priority": request.priority,
            "state": _request_state(request.status, request.num_preemptions,
                                    request.num_computed_tokens, request.num_tokens),
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_computed_prompt_tokens": min(request.num_computed_tokens,
                                              request.num_prompt_tokens),
            "num_output_tokens": request.num_output_tokens,
            "num_cached_tokens": request.num_cached_tokens,
            "num_preemptions": request.num_preemptions,
            "num_slots": kv.num_tokens(rid) if held else 0,
            "blocks": table_runs(kv.block_table(rid)) if held else [],
        })
    return {
        "version": 1, "time": time.time(), "num_blocks": kv.num_blocks,
        "block_size": kv.block_size, "blocks": base64.b64encode(states).decode("ascii"),
        "counts": counts, "shared": shared, "requests": requests,
        "totals": {"prefix_cache_queries": kv.num_prefix_queries,
                   "prefix_cache_hits": kv.num_prefix_hits,
                   "preemptions": scheduler.num_preemptions,
                   "cow_copies": kv.num_cow_copies},
    }


def planner_view(engine: Engine) -> dict[str, Any]:
    """Bytes per token, the pool's blocks and bytes, and how many sequences of max_model_len
    tokens it holds at once."""
    kv = engine.kv
    window = engine.kv_cache.window  # int4: the fp16 window pool beside the blocks
    plan = plan_for_model(engine.model_config, engine.cache_dtype,
                          context=engine.max_model_len, block_size=kv.block_size,
                          window_slots=0 if window is None else window.num_slots)
    return {"cache_dtype": engine.cache_dtype, "bytes_per_token": plan.bytes_per_token,
            "bytes_per_block": plan.bytes_per_block, "num_blocks": kv.num_blocks,
            "pool_bytes": kv.num_blocks * plan.bytes_per_block + plan.window_bytes,
            "window_bytes": plan.window_bytes,
            "max_model_len": engine.max_model_len,
            "blocks_per_sequence": plan.blocks_per_sequence,
            "max_concurrency": kv.num_blocks // plan.blocks_per_sequence}


class KVHistory:
    """Ring buffer of one sample per second over ten minutes; events are per-interval counts."""

    def __init__(self, length: int = SERIES_LENGTH, interval_s: float = SERIES_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.samples: deque[tuple[float, ...]] = deque(maxlen=length)  # (time, *SERIES_NAMES)
        self._last: tuple[float, int, int, int, int, int] | None = None  # time and counters

    def maybe_sample(self, engine: Engine, now: float) -> None:
        """Take a sample if interval_s has passed since the last one; O(1)."""
        kv = engine.kv
        scheduler = engine.scheduler
        counters = (now, kv.num_prefix_queries, kv.num_prefix_hits, scheduler.num_preemptions,
                    kv.num_cow_copies, engine.num_generated_tokens)
        last = self._last
        if last is None:
            self._last = counters
            return
        elapsed = now - last[0]
        if elapsed < self.interval_s:
            return
        queries = counters[1] - last[1]
        self.samples.append((
            time.time(), round(kv.usage(), 4),
            round((counters[2] - last[2]) / queries, 4) if queries else -1.0,
            len(scheduler.running), len(scheduler.waiting), counters[3] - last[3],
            counters[4] - last[4], round((counters[5] - last[5]) / elapsed, 1)))
        self._last = counters

    def series(self) -> dict[str, list[float | None]]:
        """Columns: `t` (unix seconds) and each of SERIES_NAMES; a hit rate with no lookups in
        its interval is None."""
        columns = list(zip(*self.samples, strict=True)) if self.samples else [()] * 8
        out: dict[str, list[float | None]] = {"t": list(columns[0])}
        for name, column in zip(SERIES_NAMES, columns[1:], strict=True):
            out[name] = [None if name == "prefix_hit_rate" and v < 0 else v for v in column]
        return out


class KVProbe:
    """What AsyncEngine's driver calls between steps: samples the series, and publishes a
    snapshot at most every PUBLISH_INTERVAL_S (longer, up to MAX_PUBLISH_INTERVAL_S, for pools
    whose build takes over MAX_BUILD_SHARE of that) while someone polled within POLL_WINDOW_S."""

    def __init__(self) -> None:
        self.history = KVHistory()
        self.last: dict[str, Any] | None = None  # replaced whole, never mutated: safe to read
        self._seq = 0
        self._published = float("-inf")
        self._polled = float("-inf")
        self._interval_s = PUBLISH_INTERVAL_S

    def poll(self) -> dict[str, Any] | None:
        self._polled = time.monotonic()
        return self.last

    async def tick(self, engine: Engine, loop: asyncio.AbstractEventLoop,
                   executor: Executor | None) -> None:
        """Between steps: a series sample (O(1), at most 1 Hz), and a snapshot when due, built
        in the step thread (the one place engine state is touched)."""
        self.history.maybe_sample(engine, time.monotonic())
        if self.due():
            await loop.run_in_executor(executor, self.publish, engine)

    def due(self) -> bool:
        now = time.monotonic()
        return (now - self._polled <= POLL_WINDOW_S
                and now - self._published >= self._interval_s)

    def publish(self, engine: Engine) -> None:
        """Build a snapshot; run it where nothing else touches the engine (the step thread)."""
        self._published = start = time.monotonic()
        snapshot = build_kv_snapshot(engine)
        build_s = time.monotonic() - start
        self._interval_s = min(MAX_PUBLISH_INTERVAL_S,
                               max(PUBLISH_INTERVAL_S, build_s / MAX_BUILD_SHARE))
        self._seq += 1
        snapshot["seq"] = self._seq
        snapshot["series"] = self.history.series()
        self.last = snapshot

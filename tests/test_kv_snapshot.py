"""The KV inspector's snapshot: the block map, block tables and counts against the pool itself."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import pytest

from engine_helpers import make_engine
from kvcore.cache import KVCacheManager
from kvcore.engine.kv_snapshot import (
    AGE_SHIFT,
    CACHED,
    FREE,
    IN_PREFIX_CACHE,
    SHARED,
    USED,
    KVHistory,
    _table_runs_loop,
    build_kv_snapshot,
    pool_snapshot,
    table_runs,
)
from kvcore.request import SequenceStatus
from kvcore.sampling import SamplingParams
from kvcore.scheduler import Scheduler
from scheduler_helpers import make_request, run_step


def expand_runs(runs: list[list[int | None]]) -> list[int | None]:
    """The inverse of table_runs, written independently: the page does the same in JS."""
    out: list[int | None] = []
    for first, count in runs:
        assert count is not None
        if first is None:
            out += [None] * count
        else:
            step = 1 if count > 0 else -1
            out += [first + step * i for i in range(abs(count))]
    return out


def test_table_runs_exact() -> None:
    assert table_runs([]) == []
    assert table_runs([7]) == [[7, 1]]
    assert table_runs([3, 4, 5, 9, 8, 7, 2, 2]) == [[3, 3], [9, -3], [2, 1], [2, 1]]
    assert table_runs([None, None, 5, 6, 1]) == [[None, 2], [5, 2], [1, 1]]
    rng = random.Random(0)
    for length in (12, 70, 300):  # the loop below 64 blocks, the array path above
        for _ in range(100):
            table: list[int | None] = [None if rng.random() < 0.1 else rng.randrange(9)
                                       for _ in range(length)]
            assert expand_runs(table_runs(table)) == table
            assert table_runs(table) == _table_runs_loop(table)
            walk: list[int | None] = [rng.randrange(1000)]  # runs up and down, as tables
            for _ in range(length - 1):
                last = walk[-1]
                if last is None:
                    walk.append(None if rng.random() < 0.5 else rng.randrange(1000))
                else:
                    walk.append(None if rng.random() < 0.05
                                else last + rng.choice([1, 1, 1, -1, -1, 5, 0]))
            assert table_runs(walk) == _table_runs_loop(walk)
            assert expand_runs(table_runs(walk)) == walk


def check_against_pool(snapshot: dict, kv: KVCacheManager) -> None:
    """Every byte, count, shared pair and table of the snapshot, from the pool's own records."""
    states = base64.b64decode(snapshot["blocks"])
    assert len(states) == kv.num_blocks
    free_queue = kv.pool.free_queue()
    cached_order = [b for b in free_queue if kv.pool.blocks[b].block_hash is not None]
    counts = {"free": 0, "cached": 0, "used": 0, "shared": 0}
    for block in kv.pool.blocks:
        byte = states[block.block_id]
        if block.ref_count == 0:
            expected = CACHED if block.block_hash is not None else FREE
        else:
            expected = USED if block.ref_count == 1 else SHARED
        assert byte & 3 == expected, block
        assert bool(byte & IN_PREFIX_CACHE) == (block.block_hash is not None), block
        counts[("free", "cached", "used", "shared")[expected]] += 1
    assert snapshot["counts"] == counts
    # the LRU age never decreases along the free queue: the next evicted has age 0
    ages = [states[b] >> AGE_SHIFT for b in cached_order]
    assert ages == sorted(ages) and (not ages or ages[0] == 0)
    shared = {b.block_id: b.ref_count for b in kv.pool.blocks if b.ref_count > 1}
    assert dict(map(tuple, snapshot["shared"])) == shared
    holders: dict[int, int] = {}
    for request in snapshot["requests"]:
        if request["id"] not in kv:
            assert request["blocks"] == [] and request["state"] in ("waiting", "preempted")
            continue
        table = expand_runs(request["blocks"])
        assert table == kv.block_table(request["id"])
        assert request["num_slots"] == kv.num_tokens(request["id"])
        for block_id in table:
            if block_id is not None:
                holders[block_id] = holders.get(block_id, 0) + 1
    # the owners the page derives from the tables are exactly the references
    assert holders == {b.block_id: b.ref_count for b in kv.pool.blocks if b.ref_count}


def test_snapshot_of_a_running_engine_matches_the_pool(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, num_blocks=48)
    prefix = list(range(10, 30))  # 5 full blocks of 4 shared by every request
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prefix + [40 + i, 41 + i], params)
    engine.add_request("n2", prefix + [77, 78, 79], SamplingParams(n=2, max_tokens=12,
                                                                    temperature=1.0, seed=1,
                                                                    ignore_eos=True))
    seen = {"shared": False, "cached": False, "decoding": False}
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = build_kv_snapshot(engine)
        json.dumps(snapshot)  # plain JSON data
        check_against_pool(snapshot, engine.kv)
        seen["shared"] |= snapshot["counts"]["shared"] > 0
        seen["cached"] |= snapshot["counts"]["cached"] > 0
        seen["decoding"] |= any(r["state"] == "decoding" for r in snapshot["requests"])
        for request in snapshot["requests"]:
            assert set(request) >= {"num_prompt_tokens", "num_computed_prompt_tokens",
                                    "num_output_tokens", "num_cached_tokens", "priority"}
    assert seen == {"shared": True, "cached": True, "decoding": True}
    assert engine.kv.num_cow_copies > 0  # n=2 over a prompt ending inside a block
    snapshot = build_kv_snapshot(engine)
    assert snapshot["totals"]["cow_copies"] == engine.kv.num_cow_copies
    planner = snapshot["planner"]
    # tiny model: 2 layers x 2 KV heads x head_dim 16 x fp16 (the CPU default), K and V
    assert planner["bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert planner["max_concurrency"] == 48 // planner["blocks_per_sequence"]
    # counts and ids only: the only strings are ids, states, the block map and the dtype, and
    # no list is longer than a block table's runs (no token ids)
    strings: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk({k: v for k, v in snapshot.items() if k != "blocks"})
    allowed = {"fp16", "waiting", "preempted", "prefilling", "decoding"}
    allowed |= {r["id"] for r in snapshot["requests"]} | {r["group"] for r in snapshot["requests"]}
    assert set(strings) <= allowed


def test_cow_counter_counts_each_copy() -> None:
    kv = KVCacheManager(8, 4)
    assert kv.allocate_prefix("a", [1, 2, 3, 4, 5, 6]) == 0
    assert kv.allocate_slots("a", [1, 2, 3, 4, 5, 6], 6) == []
    kv.fork("a", "b")
    ops = kv.allocate_slots("b", [1, 2, 3, 4, 5, 6, 7], 1)
    assert ops == [(1, 2)] and kv.num_cow_copies == 1
    assert kv.allocate_slots("a", [1, 2, 3, 4, 5, 6, 8], 1) == []  # now exclusively a's
    assert kv.num_cow_copies == 1


def test_history_rates_per_interval() -> None:
    scheduler = Scheduler(KVCacheManager(16, 4), 64, 4)
    fake = type("E", (), {"kv": scheduler.kv, "scheduler": scheduler,  # what it reads
                          "num_generated_tokens": 0})()
    history = KVHistory(length=3, interval_s=1.0)
    history.maybe_sample(fake, 0.0)  # type: ignore[arg-type]
    fake.num_generated_tokens = 30
    history.maybe_sample(fake, 0.5)  # type: ignore[arg-type]  # too early: no sample
    history.maybe_sample(fake, 2.0)  # type: ignore[arg-type]
    series = history.series()
    assert series["tokens_per_s"] == [15.0] and series["prefix_hit_rate"] == [None]
    for t in range(3, 9):
        history.maybe_sample(fake, float(t))  # type: ignore[arg-type]
    assert len(history.series()["t"]) == 3  # the ring keeps the newest `length`


@pytest.mark.parametrize("churn", [False, True])
def test_a_full_100k_block_pool_encodes_under_300_kb(churn: bool) -> None:
    """256 sequences fill a 100,000-block pool (plus cached blocks after churn): < 300 KB."""
    scheduler = Scheduler(KVCacheManager(100_000, 16), 1 << 22, 256)
    rng = random.Random(1)
    prefix = [rng.randrange(1, 1000) for _ in range(1024)]  # shared by every other request
    num = 0

    def add() -> None:
        nonlocal num
        own = [rng.randrange(1, 1000) for _ in range(rng.randrange(5200, 7000))]
        scheduler.add(make_request(f"req-{num:05d}", (prefix if num % 2 else []) + own,
                                           max_tokens=16))
        num += 1

    for _ in range(256):
        add()
    run_step(scheduler)
    if churn:  # finish a random half, admit new ones: tables out of a reordered free queue
        for _ in range(3):
            for request in rng.sample(scheduler.running, len(scheduler.running) // 2):
                scheduler.finish(request, SequenceStatus.FINISHED_ABORTED)
            for _ in range(128):
                add()
            run_step(scheduler)
    kv = scheduler.kv
    fake = type("E", (), {"kv": kv, "scheduler": scheduler, "num_generated_tokens": 10**9})()
    assert kv.usage() > 0.9
    snapshot = pool_snapshot(kv, scheduler)
    history = KVHistory()  # and ten full minutes of series, as /debug/kv sends them
    for t in range(601):
        fake.num_generated_tokens += 12345
        history.maybe_sample(fake, float(t))  # type: ignore[arg-type]
    snapshot["series"] = history.series()
    assert len(snapshot["series"]["t"]) == 600
    size = len(json.dumps(snapshot, separators=(",", ":")))
    print(f"/debug/kv of a full 100k-block pool: {size} bytes")
    assert size < 300_000, size
    check_against_pool(snapshot, kv)


def test_async_engine_publishes_only_while_polled_and_at_a_bounded_rate(
        tiny_model_dir: Path) -> None:
    import asyncio
    import time

    from kvcore.engine import AsyncEngine
    from kvcore.engine.kv_snapshot import PUBLISH_INTERVAL_S

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def run_all(ae: AsyncEngine, num: int) -> None:
        async def one(i: int) -> None:
            async for _ in ae.generate([5 + i] * 9, params):
                pass
        await asyncio.gather(*(one(i) for i in range(num)))

    async def main() -> None:
        async with AsyncEngine(make_engine(tiny_model_dir, num_blocks=64)) as ae:
            await run_all(ae, 4)
            assert await ae.kv_snapshot() is None  # nobody asked: nothing was ever built
            assert ae._kv_probe._seq == 0
            snapshot = None
            for _ in range(200):  # idle: the poll wakes the driver, which publishes
                snapshot = await ae.kv_snapshot()
                if snapshot is not None:
                    break
                await asyncio.sleep(0.01)
            assert snapshot is not None and snapshot["seq"] == 1
            assert snapshot["requests"] == [] and snapshot["counts"]["cached"] > 0
            start = time.monotonic()
            task = asyncio.create_task(run_all(ae, 6))
            seqs = set()
            while not task.done():
                latest = await ae.kv_snapshot()
                assert latest is not None
                seqs.add(latest["seq"])
                await asyncio.sleep(0.005)
            await task
            elapsed = time.monotonic() - start
            # at most one build per PUBLISH_INTERVAL_S however often it is polled
            assert ae._kv_probe._seq - 1 <= elapsed / PUBLISH_INTERVAL_S + 1
            assert len(seqs) >= 1

    asyncio.run(main())

"""The pool and the KV tiers under a Hypothesis state machine: sequences are added, run (their
blocks evicted into the tiers and loaded back), preempted (swapped out), aborted, and the engine
restarts over the same disk directory. Every step checks that the K/V a step reads is what its
tokens computed (a wrong restore cannot hide), that every block's references are its sequences'
plus the driver's, and that each tier holds what it says within its budget."""

from __future__ import annotations

import contextlib
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcore.cache import KVCacheManager, chain_hashes
from kvcore.cache.kv_cache import KVCache
from kvcore.cache.tiers import DiskTier, HostTier, PageCopier, TierStore, make_codec
from kvcore.engine.tier_driver import TierDriver
from kvcore.request import SequenceStatus
from kvcore.scheduler import Scheduler
from scheduler_helpers import make_request, stub_token

NUM_BLOCKS, BS = 12, 2
PREFIXES = [list(range(7, 15)), list(range(20, 26)), list(range(30, 34))]


def value(tokens: list[int]) -> float:
    """The "K/V" of the last of these tokens: a function of its whole prefix."""
    return float(zlib.crc32(struct.pack(f"<{len(tokens)}q", *tokens)) % (1 << 20))


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.driver: TierDriver | None = None

    @initialize(root=st.just(None), policy=st.sampled_from(
        ["write_back", "write_through", "write_through_selective"]))
    def start(self, root: None, policy: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvtier-sm-"))
        self.policy = policy
        self.expected: dict[bytes, bytes] = {}  # chain hash -> the page its tokens computed
        self.boot()

    def boot(self) -> None:
        """A fresh engine (pool, scheduler, host tier) over the same disk directory."""
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.scheduler = Scheduler(self.kv, max_num_batched_tokens=8, max_num_seqs=3)
        self.cache = KVCache(1, NUM_BLOCKS, BS, 1, 2, "fp32")
        copier = PageCopier(self.cache)
        page = copier.layout.page_bytes
        self.host = HostTier(3 * page, make_codec("auto", copier.layout))
        self.disk = DiskTier(self.dir, 6 * (page + 92 + 8 * BS), b"f" * 32, page, BS)
        store = TierStore([self.host, self.disk], page, copier.host_buffer)
        self.driver = TierDriver(self.kv, store, copier, self.scheduler.seqs, self.policy,
                                 swap=True)
        self.scheduler.tiers = self.driver

    def teardown(self) -> None:
        if self.driver is not None:
            self.driver.close(5.0)

    # --- rules ---

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(40, 99), max_size=6),
          salt=st.sampled_from([None, "t1"]), max_tokens=st.integers(1, 6))
    def add(self, prefix: list[int], tail: list[int], salt: str | None, max_tokens: int) -> None:
        self.count += 1
        seq = make_request(f"r{self.count}", prefix + tail, max_tokens=max_tokens, salt=salt)
        with contextlib.suppress(ValueError):  # larger than the whole pool: refused
            self.scheduler.add(seq)

    @rule(num=st.integers(1, 4))
    def step(self, num: int) -> None:
        for _ in range(num):
            self.one_step()

    def one_step(self) -> None:
        assert self.driver is not None
        out = self.scheduler.schedule()
        ops = self.driver.take_ops(out.num_batched_tokens) if out.scheduled else None
        if ops is not None:
            ops()  # the device work: gathers then scatters, before the forward
        k = self.cache.key_caches[0]
        for item in out.scheduled:
            seq = self.scheduler.seqs[item.seq_id]
            tokens = seq.token_ids
            for p in range(item.start):  # what this step reads: computed or restored K/V
                block = item.block_ids[p // BS]
                assert block is not None
                assert k[block, p % BS, 0, 0] == value(tokens[:p + 1]), (item.seq_id, p)
            for i in range(len(item.token_ids)):  # the forward writes its tokens
                p = item.start + i
                block = item.block_ids[p // BS]
                assert block is not None
                k[block, p % BS, 0, :] = value(tokens[:p + 1])
                self.cache.value_caches[0][block, p % BS, 0, :] = value(tokens[:p + 1]) + 1
        self.scheduler.advance(out)
        self.record_pages()
        for item in out.scheduled:
            seq = self.scheduler.seqs.get(item.seq_id)
            if seq is not None and item.sample:
                status = seq.append_token(stub_token(seq))
                if status is not None:
                    self.scheduler.finish(seq, status)
        self.driver.after_step(0.001 + 0.001 * out.num_batched_tokens, [])  # 1 ms a token
        self.settle()

    def record_pages(self) -> None:
        """The page each full computed block is, by its chain hash (what a tier must give)."""
        for seq in self.scheduler.running:
            bs = BS
            table = self.kv.block_ids(seq.seq_id)
            hashes = chain_hashes(seq.token_ids, bs, seq.cache_salt,
                                  seq.num_computed_tokens // bs)
            for i, block_hash in enumerate(hashes):
                block = table[i]
                assert block is not None
                self.expected[block_hash] = (self.cache.key_caches[0][block].tobytes()
                                             + self.cache.value_caches[0][block].tobytes())

    def settle(self) -> None:
        """Writes land and loads finish before the next rule (deterministic runs)."""
        assert self.driver is not None
        assert self.driver.store.flush(10.0)
        for load in list(self.driver._loads.values()):
            assert load.job.done.wait(10.0)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.scheduler.running))
        self.scheduler.preempt(seq)

    @precondition(lambda self: bool(self.scheduler.seqs))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        assert self.driver is not None
        seq = data.draw(st.sampled_from(sorted(self.scheduler.seqs.values(),
                                               key=lambda s: s.seq_id)))
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.driver.forget(seq.request_id)

    @precondition(lambda self: self.scheduler._step >= 12)  # a restart after some work
    @rule()
    def restart(self) -> None:
        assert self.driver is not None
        for seq in list(self.scheduler.seqs.values()):
            self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            self.driver.forget(seq.request_id)
        self.driver.close(10.0)
        self.boot()

    # --- invariants ---

    @invariant()
    def references_are_the_sequences_plus_the_drivers(self) -> None:
        if self.driver is None:
            return
        refs = [0] * NUM_BLOCKS
        for seq_id in self.kv.seq_ids():
            for block_id in self.kv.block_ids(seq_id):
                if block_id is not None:
                    refs[block_id] += 1
        for load in self.driver._loads.values():
            for block in (*load.blocks, *load.pinned):
                refs[block.block_id] += 1
        for block in self.driver._held:
            refs[block.block_id] += 1
        assert [b.ref_count for b in self.kv.pool.blocks] == refs
        assert self.kv.num_free_blocks == refs.count(0) == len(self.kv.pool.free_queue())
        if not self.scheduler.seqs:
            assert not self.driver._loads and not self.driver._held  # nothing leaks

    @invariant()
    def tiers_hold_exact_pages_within_budget(self) -> None:
        if self.driver is None:
            return
        assert self.host.num_bytes <= self.host.capacity_bytes
        assert self.disk.num_bytes <= self.disk.capacity_bytes
        files = sorted(p.name for p in self.disk.dir.rglob("*.kvpage"))
        assert len(files) == self.disk.num_pages
        out = np.zeros(self.driver.page_bytes, np.uint8)
        for name in files:
            block_hash = bytes.fromhex(name[:64])
            tokens = self.disk_tokens(block_hash)
            assert self.disk.get(block_hash, tokens, out)
            assert out.tobytes() == self.expected[block_hash]
        for block_hash, (tokens, _) in list(self.host._pages.items()):
            assert self.host.get(block_hash, tokens, out)
            assert out.tobytes() == self.expected[block_hash]

    def disk_tokens(self, block_hash: bytes) -> bytes:
        path = self.disk._path(block_hash)
        header = path.read_bytes()[:92 + 8 * BS]
        return header[88:88 + 8 * BS]


TierMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40,
                                         deadline=None)
test_tier_state_machine = TierMachine.TestCase


def test_a_seeded_walk_restores_pages_and_keeps_every_invariant() -> None:
    """The machine's rules in a seeded random order, long enough that pages leave the pool
    and come back from the tiers (Hypothesis explores the corners; this walk guarantees the
    load path ran)."""
    rng = np.random.default_rng(0)
    hits = 0
    for policy in ("write_back", "write_through", "write_through_selective"):
        machine = TierMachine()
        machine.start(None, policy)
        for _ in range(150):
            roll = rng.random()
            if roll < 0.3:
                prefix = PREFIXES[int(rng.integers(len(PREFIXES)))]
                tail = rng.integers(40, 99, int(rng.integers(0, 7))).tolist()
                machine.add(prefix, tail, [None, "t1"][int(rng.integers(2))],
                            int(rng.integers(1, 7)))
            elif roll < 0.35 and machine.scheduler.running:
                running = machine.scheduler.running
                machine.scheduler.preempt(running[int(rng.integers(len(running)))])
            else:
                machine.step(1)
            machine.references_are_the_sequences_plus_the_drivers()
            machine.tiers_hold_exact_pages_within_budget()
        assert machine.driver is not None
        hits += sum(machine.driver.store.counters.hits.values())
        machine.teardown()
    assert hits > 0

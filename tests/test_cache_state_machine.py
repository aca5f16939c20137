"""Stateful test: the real KVCacheManager beside a trivially correct model of its sequences.

The model keeps each sequence's tokens, a fake KV store (slot -> the token the forward pass would
have written there, copy ops applied first) and the prefix cache as a plain dict from
(salt, prompt prefix) to block id. KVCORE_HYPOTHESIS_EXAMPLES=5000 runs a much longer search.
"""

from __future__ import annotations

import os
import struct

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvcore.cache import Admission, KVCacheManager
from kvcore.cache.block_pool import hash_block

BS = 4
NUM_BLOCKS = 24
EXAMPLES = int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TOKENS = st.integers(0, 2)  # a small alphabet, so prompts share prefixes and blocks collide
SALTS = st.sampled_from([None, "t1", "t2"])


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")
    window: int | None = None

    @initialize()
    def setup(self) -> None:
        self.m = KVCacheManager(NUM_BLOCKS, BS, sliding_window=self.window)
        self.tokens: dict[str, list[int]] = {}  # the model: every allocated token per sequence
        self.salt: dict[str, str | None] = {}
        self.kv: dict[int, int] = {}  # fake KV store: slot -> token id written there
        self.prefix_cache: dict[tuple[str | None, tuple[int, ...]], int] = {}
        self.num_released: dict[str, int] = {}  # leading blocks the window released
        self.history: list[tuple[list[int], str | None]] = []  # token lists seen, freed ones too
        self.next_id = 0
        self.next_token = 1000  # tokens outside the alphabet, for eviction pressure

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def snapshot(self) -> tuple:
        m = self.m
        return ({s: (m.block_table(s), m.num_tokens(s)) for s in m.seq_ids()},
                [(b.ref_count, b.block_hash, b.token_bytes) for b in m.pool.blocks],
                m.pool.free_queue(), dict(m.pool.cached), m.num_free_blocks)

    def grow(self, seq_id: str, tokens: list[int], num_new: int) -> bool:
        """allocate_slots, then what the runner does: copies first, then the forward's writes."""
        before = self.snapshot()
        old_table = set(self.m.block_table(seq_id))
        start = self.m.num_tokens(seq_id)
        ops = self.m.allocate_slots(seq_id, tokens, num_new)
        if ops is None:
            assert self.snapshot() == before, "a failed allocation changed state"
            return False
        table = self.m.block_table(seq_id)
        for block_id in set(table) - old_table:  # fresh from the pool: its cache entry is gone
            assert block_id is not None
            for key in [k for k, v in self.prefix_cache.items() if v == block_id]:
                del self.prefix_cache[key]
        for src, dst in ops:
            assert dst in table and src not in table
            for off in range(BS):
                if src * BS + off in self.kv:
                    self.kv[dst * BS + off] = self.kv[src * BS + off]
        for pos in range(start, start + num_new):
            slot = self.m.slot(seq_id, pos)
            assert self.m.pool.blocks[slot // BS].ref_count == 1, "write into a shared block"
            self.kv[slot] = tokens[pos]
        if self.m.enable_prefix_caching:
            salt = self.salt[seq_id]
            for i in range(start // BS, (start + num_new) // BS):
                self.prefix_cache.setdefault((salt, tuple(tokens[:(i + 1) * BS])), table[i])
        self.tokens[seq_id] = tokens
        return True

    @rule(target=seqs, prompt=st.lists(TOKENS, min_size=1, max_size=6 * BS), salt=SALTS)
    def add(self, prompt: list[int], salt: str | None) -> object:
        return self.start(prompt, salt)

    def start(self, prompt: list[int], salt: str | None) -> object:
        m = self.m
        num_needed = -(-len(prompt) // BS)
        admission = m.admission(len(prompt))
        expected = (Admission.NEVER if num_needed > NUM_BLOCKS else
                    Admission.NOT_NOW if num_needed > m.num_free_blocks else Admission.OK)
        assert admission is expected
        hits: list[int] = []
        if m.enable_prefix_caching:
            while len(hits) < (len(prompt) - 1) // BS:
                key = (salt, tuple(prompt[:(len(hits) + 1) * BS]))
                if key not in self.prefix_cache:
                    break
                hits.append(self.prefix_cache[key])
        queries, num_hits = m.num_prefix_queries, m.num_prefix_hits
        seq_id = self.new_id()
        num_cached = m.allocate_prefix(seq_id, prompt, salt)
        assert num_cached == len(hits) * BS
        assert m.block_table(seq_id) == hits
        if m.enable_prefix_caching:
            assert m.num_prefix_queries - queries == len(prompt)
            assert m.num_prefix_hits - num_hits == num_cached
        for pos in range(num_cached):  # a hit serves exactly the prompt's K/V
            assert self.kv[m.slot(seq_id, pos)] == prompt[pos]
        self.salt[seq_id] = salt
        self.tokens[seq_id] = prompt[:num_cached]
        self.num_released[seq_id] = 0
        if not self.grow(seq_id, prompt, len(prompt) - num_cached):
            assert admission is not Admission.OK
            self.forget(seq_id)
            return multiple()
        self.history.append((prompt, salt))
        return seq_id

    @precondition(lambda self: self.history)
    @rule(target=seqs, data=st.data(), extra=st.lists(TOKENS, max_size=BS))
    def add_shared(self, data: st.DataObject, extra: list[int]) -> object:
        """A prompt that starts like an earlier (maybe freed) sequence: shared system prompts."""
        source, source_salt = data.draw(st.sampled_from(self.history))
        # often at a block boundary, so whole prompts can be cached (and the hit cap matters)
        cut = data.draw(st.one_of(st.sampled_from(range(0, len(source) + 1, BS)),
                                  st.integers(0, len(source))))
        salt = data.draw(st.one_of(st.just(source_salt), SALTS))
        return self.start((source[:cut] + extra) or [0], salt)

    @rule(seq_id=seqs, new=st.lists(TOKENS, min_size=1, max_size=2 * BS))
    def append(self, seq_id: str, new: list[int]) -> None:
        self.grow(seq_id, self.tokens[seq_id] + new, len(new))

    @rule(target=seqs, parent=seqs)
    def fork(self, parent: str) -> str:
        child = self.new_id()
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salt[child] = self.salt[parent]
        self.num_released[child] = self.num_released[parent]
        assert self.m.block_table(child) == self.m.block_table(parent)
        return child

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id: str) -> None:
        self.forget(seq_id)

    def forget(self, seq_id: str) -> None:
        self.m.free(seq_id)
        self.history.append((self.tokens[seq_id], self.salt[seq_id]))
        for table in (self.tokens, self.salt, self.num_released):
            del table[seq_id]

    @precondition(lambda self: self.m.num_free_blocks > 0)
    @rule()
    def pressure(self) -> None:
        """A sequence of fresh tokens takes every free block, evicting every cached free block."""
        num = self.m.num_free_blocks * BS
        prompt = list(range(self.next_token, self.next_token + num))
        self.next_token += num
        seq_id = self.start(prompt, None)
        assert isinstance(seq_id, str)
        assert self.m.num_free_blocks == 0
        self.forget(seq_id)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.m.reset_prefix_cache()
        self.prefix_cache.clear()
        assert self.m.pool.cached == {}

    @invariant()
    def refcounts_match_block_tables(self) -> None:
        m = self.m
        held = [0] * NUM_BLOCKS
        for s in m.seq_ids():
            for block_id in m.block_table(s):
                if block_id is not None:
                    held[block_id] += 1
        assert [b.ref_count for b in m.pool.blocks] == held
        for s in m.seq_ids():  # the id list the scheduler hands out equals the block objects'
            assert m.block_ids(s) == [None if b is None else b.block_id
                                      for b in m._seqs[s].blocks]
        in_use = sum(1 for n in held if n)
        assert m.num_free_blocks + in_use == NUM_BLOCKS
        free = m.pool.free_queue()
        assert len(free) == len(set(free)) == m.num_free_blocks
        assert all(held[b] == 0 for b in free), "a block is both free and referenced"
        assert m.usage() == in_use / NUM_BLOCKS
        if not self.tokens:
            assert m.usage() == 0.0

    @invariant()
    def sequences_read_back_their_tokens(self) -> None:
        m = self.m
        assert sorted(m.seq_ids()) == sorted(self.tokens)
        for s, tokens in self.tokens.items():
            assert m.num_tokens(s) == len(tokens)
            table = m.block_table(s)
            assert len(table) == -(-len(tokens) // BS)
            released = self.num_released[s]
            assert all(b is None for b in table[:released])
            assert all(b is not None for b in table[released:])
            for pos in range(released * BS, len(tokens)):
                assert self.kv[m.slot(s, pos)] == tokens[pos]

    @invariant()
    def cached_hashes_match_their_tokens(self) -> None:
        m = self.m
        assert sorted(m.pool.cached.values(), key=id) == sorted(
            (m.pool.blocks[b] for b in self.prefix_cache.values()), key=id)
        for block_hash, block in m.pool.cached.items():
            assert block.block_hash == block_hash
            assert block.token_bytes is not None
            stored = list(struct.unpack(f"<{BS}q", block.token_bytes))
            assert stored == [self.kv[block.block_id * BS + off] for off in range(BS)]
        for s, tokens in self.tokens.items():  # the chain hash of every full block
            seq, parent = m._seqs[s], None
            salt = self.salt[s]
            for i, block_hash in enumerate(seq.block_hashes):
                extra = b"" if i or salt is None else b"\x01" + salt.encode()
                packed = m.pool.pack_tokens(tokens[i * BS:(i + 1) * BS])
                assert block_hash == hash_block(parent, packed, extra)
                parent = block_hash
        for (salt, _prefix), block_id in self.prefix_cache.items():
            owners = {self.salt[s] for s in self.tokens if block_id in self.m.block_table(s)}
            assert owners <= {salt}, "a block shared across salts"


class WindowMachine(CacheMachine):
    """The same rules with a sliding window (so no prefix caching) and window releases."""

    window = 6

    @rule(seq_id=CacheMachine.seqs, data=st.data())
    def release(self, seq_id: str, data: st.DataObject) -> None:
        num_computed = data.draw(st.integers(0, self.m.num_tokens(seq_id)))
        self.m.release_outside_window(seq_id, num_computed)
        limit = num_computed - self.window
        out = (limit + 1) // BS if limit >= 0 else 0
        self.num_released[seq_id] = max(self.num_released[seq_id], out)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = SETTINGS
TestWindowMachine = WindowMachine.TestCase
TestWindowMachine.settings = SETTINGS

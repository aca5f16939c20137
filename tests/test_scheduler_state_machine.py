"""A Hypothesis state machine over the scheduler and the real KVCacheManager, with a stub model.

Rules add requests (random lengths and priorities, some rejected at admission), abort them, and
step with random token budgets. Invariants: the budget and max_num_seqs are never exceeded, every
running request gets tokens each step (budget >= max_num_seqs), no request waits past a bound,
refcounts equal the block-table references (no leak), and everything drains to an empty pool.
Longer runs: KVCORE_HYPOTHESIS_EXAMPLES=2000.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvcore.request import SequenceStatus
from scheduler_helpers import EOS, make_request, make_scheduler, stub_token
from scheduler_helpers import counts as scheduled_counts

MAX_NUM_SEQS = 4
NUM_BLOCKS = 24
BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # the requests it makes stay within it (the engine checks, not the scheduler)


class SchedulerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                budget=3 * MAX_NUM_SEQS, max_num_seqs=MAX_NUM_SEQS)
        self.num_added = 0
        self.step_no = 0
        self.added_at: dict[str, int] = {}
        self.total_work = 0  # prompt + max_tokens of every request ever added

    @rule(target=requests, prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 24),
          priority=st.integers(0, 2), stops_early=st.booleans())
    def add(self, prompt_len: int, max_tokens: int, priority: int, stops_early: bool) -> str:
        self.num_added += 1
        request_id = f"q{self.num_added}"
        # the engine's check, before a sequence reaches here: prompt + max_tokens fit the context
        max_tokens = max(1, min(max_tokens, MAX_MODEL_LEN - prompt_len))
        request = make_request(request_id, prompt_len, max_tokens, priority,
                               ignore_eos=not stops_early)
        worst = prompt_len + max_tokens
        fits = -(-worst // BLOCK_SIZE) <= NUM_BLOCKS
        try:
            self.s.add(request)
        except ValueError:
            assert not fits
            assert request_id not in self.s.seqs
            return request_id
        assert fits
        self.added_at[request_id] = self.step_no
        self.total_work += worst
        return request_id

    @rule(request_id=consumes(requests))
    def abort(self, request_id: str) -> None:
        request = self.s.seqs.get(request_id)
        if request is not None:
            self.s.finish(request, SequenceStatus.FINISHED_ABORTED)
            assert request_id not in self.s.kv and request_id not in self.s.seqs
        self.added_at.pop(request_id, None)

    @precondition(lambda self: self.s.seqs)
    @rule(budget=st.integers(MAX_NUM_SEQS, 4 * MAX_NUM_SEQS))
    def step(self, budget: int) -> None:
        s = self.s
        running_before = {r.seq_id for r in s.running}
        s.max_num_batched_tokens = budget
        out = s.schedule()
        self.step_no += 1
        counts = dict(scheduled_counts(out))
        assert len(counts) == len(out.scheduled)
        assert 0 <= out.num_batched_tokens == sum(counts.values()) <= budget
        assert all(n >= 1 for n in counts.values())
        assert len(s.running) <= MAX_NUM_SEQS
        # decode-first with budget >= max_num_seqs: every running request progresses
        for seq_id in running_before - set(out.preempted_ids):
            if seq_id in s.seqs:
                assert seq_id in counts, f"{seq_id} got no tokens"
        for item in out.scheduled:
            seq = s.seqs[item.seq_id]
            n = len(item.token_ids)
            assert item.start == seq.num_computed_tokens
            assert item.token_ids == seq.token_ids[item.start:item.start + n]
            assert item.sample == (seq.num_computed_tokens + n == seq.num_tokens)
            assert item.block_ids == s.kv.block_table(item.seq_id)
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert s.kv.num_tokens(item.seq_id) == seq.num_computed_tokens + n
        s.advance(out)
        for item in out.scheduled:
            seq = s.seqs[item.seq_id]
            if item.sample:
                token = EOS if seq.num_tokens % 7 == 0 else stub_token(seq)
                status = seq.append_token(token)
                if status is not None:
                    s.finish(seq, status)
                    self.added_at.pop(seq.seq_id, None)

    @invariant()
    def no_starvation(self) -> None:
        # the oldest, most important request always advances, and recompute after a preemption
        # at most repeats a request's work: nobody waits longer than all the work there is
        bound = self.total_work * (1 + self.s.num_preemptions) + 1
        for request_id, added in self.added_at.items():
            assert self.step_no - added <= bound, f"{request_id} starves"

    @invariant()
    def refcounts_match_block_tables(self) -> None:
        kv = self.s.kv
        held = Counter(b for seq_id in kv.seq_ids() for b in kv.block_table(seq_id)
                       if b is not None)
        for block in kv.pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0)
        assert kv.num_free_blocks == sum(1 for b in kv.pool.blocks if b.ref_count == 0)
        assert set(kv.seq_ids()) == {r.seq_id for r in self.s.running}
        assert {r.seq_id for r in self.s.waiting} | set(kv.seq_ids()) == set(self.s.seqs)

    def teardown(self) -> None:
        s = self.s
        for _ in range(10 * (self.total_work + 1) * (1 + s.num_preemptions)):
            if not s.seqs:
                break
            self.step(budget=3 * MAX_NUM_SEQS)
        assert not s.seqs
        assert s.kv.usage() == 0.0
        assert all(block.ref_count == 0 for block in s.kv.pool.blocks)


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVCORE_HYPOTHESIS_EXAMPLES", "60")),
    stateful_step_count=40, deadline=None)
TestSchedulerMachine = SchedulerMachine.TestCase

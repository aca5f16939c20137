"""Token-budget continuous batching of sequences: chunked prefill, priorities, preemption."""

from __future__ import annotations

import bisect
import operator
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from kvcore.cache import Admission, CopyOp, KVCacheManager
from kvcore.request import Sequence, SequenceStatus

log = structlog.get_logger(__name__)


@dataclass(slots=True)  # plain data, never changed (not frozen: one per sequence per step)
class ScheduledSeq:
    """One sequence's part of a step: everything the runner needs to build its batch rows."""

    seq_id: str
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk, or one token)
    start: int  # position of token_ids[0]: the sequence's num_computed_tokens
    # its block table (None: released by the sliding window); the manager's own list, valid
    # until the next schedule() changes it: read during this step only
    block_ids: list[int | None]
    sample: bool  # the chunk reaches the end of its tokens: the step samples its next token
    # speculative decoding: token_ids ends with this many draft tokens (not in the sequence
    # yet); the step samples after its last token and after each of them
    num_draft_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes: self-contained plain data (the runner needs nothing else)."""

    scheduled: tuple[ScheduledSeq, ...]  # batch order
    copy_ops: tuple[CopyOp, ...]  # copy-on-write block copies, run before the forward pass
    preempted_ids: tuple[str, ...]  # sent back to waiting this step (their K/V is gone)
    num_batched_tokens: int


class TierHook(Protocol):
    """The KV tiers (kvcore.engine.tier_driver): ready() is False while a waiting sequence's
    prefix loads (later ones may start); on_preempt() before a victim's blocks are freed."""
    def ready(self, seq: Sequence) -> bool: ...
    def on_preempt(self, seq: Sequence) -> None: ...


class Scheduler:
    """Every sequence's `num_computed_tokens` catches up with its tokens, under a token budget.

    Order within a step: running sequences with one token to compute (decodes) in least recently
    served order, then running sequences still prefilling (their chunk is what budget remains),
    then waiting sequences FCFS within priority (lower number first). When the pool runs out of
    blocks the running sequence with the largest (priority, arrival) is preempted: its blocks are
    freed, its num_computed_tokens reset, and it goes back to the front of its priority level
    in the waiting queue (its earlier arrival puts it ahead of the later ones).
    """

    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        assert max_num_batched_tokens >= 1 and max_num_seqs >= 1  # SchedulerConfig checks them
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival_seq)
        self.num_preemptions = 0
        # forks still to come of running sequences (Sequence.num_pending_forks): they count
        # toward max_num_seqs from admission on, so forks never exceed it
        self.num_pending_forks = 0
        self._arrivals = 0
        self._step = 0
        self.tiers: TierHook | None = None

    # --- sequences in and out ---

    def add(self, seq: Sequence) -> None:
        """Queue a sequence that can run (Engine.check_request refused the others: too long,
        more sequences than max_num_seqs, more blocks than the pool)."""
        if seq.seq_id in self.seqs:
            raise ValueError("seq_id is already in use")
        assert seq.num_seqs <= self.max_num_seqs
        assert self.kv.admission(seq.num_prompt_tokens + seq.max_tokens) is not Admission.NEVER
        self._arrivals += 1
        seq.arrival_seq = self._arrivals
        self._enqueue(seq)
        self.seqs[seq.seq_id] = seq

    def add_running(self, seq: Sequence, parent: Sequence) -> None:
        """A fork of a running sequence: it shares every block of `parent`."""
        if seq.seq_id in self.seqs:
            raise ValueError("seq_id is already in use")
        self.kv.fork(parent.seq_id, seq.seq_id)
        if parent.num_pending_forks > 0:
            parent.num_pending_forks -= 1
            self.num_pending_forks -= 1
        seq.arrival_seq = parent.arrival_seq
        seq.num_computed_tokens = parent.num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        seq.last_scheduled_step = parent.last_scheduled_step
        self.running.append(seq)
        self.seqs[seq.seq_id] = seq

    def finish(self, seq: Sequence, status: SequenceStatus, uncache: bool = False) -> None:
        """End a sequence and free its blocks (`uncache`: see KVCacheManager.free)."""
        assert status.finished
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq, uncache)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = status
        del self.seqs[seq.seq_id]

    # --- one step ---

    def schedule(self, drafts: Mapping[str, list[int]] | None = None) -> SchedulerOutput:
        """Pick this step's tokens; at most max_num_batched_tokens.
        `drafts`: draft tokens by sequence id, verified after a decode's token where budget
        and pool allow (cut to the budget; dropped rather than preempting anyone)."""
        self._step += 1
        plan = _Plan(self._step, self.max_num_batched_tokens)
        kv = self.kv
        allocate = kv.allocate_slots
        take = plan.take
        step, scheduled, copy_ops = plan.step, plan.num_new, plan.copy_ops
        running = SequenceStatus.RUNNING
        prefilling: list[Sequence] = []
        # pass 1: decodes (one token to compute), least recently served first
        for seq in list(self.running):
            if seq.status is not running:
                continue  # preempted earlier in this step
            num_new = len(seq.token_ids) - seq.num_computed_tokens
            if num_new > 1:
                prefilling.append(seq)
            elif num_new == 1 and plan.budget > 0:  # 0: waits for its group (the core decides)
                draft = (drafts.get(seq.seq_id) or [])[:plan.budget - 1] if drafts else []
                # drafts take blocks only while every running sequence still finds one free: a
                # draft never costs anyone a preemption
                copies = (allocate(seq.seq_id, seq.token_ids, 1, len(draft))
                          if draft and kv.num_free_blocks > len(self.running)
                          + len(draft) // kv.block_size else None)
                if copies is None:
                    draft = []  # short of blocks: no drafts before anyone is preempted
                    copies = allocate(seq.seq_id, seq.token_ids, 1)
                if copies is None:
                    self._make_room(plan, seq, 1)
                    continue
                if draft:
                    plan.drafts[seq.seq_id] = draft
                # plan.take, inlined: once per decode per step, the scheduler's hot path
                scheduled[seq.seq_id] = num_new = 1 + len(draft)
                if copies:
                    copy_ops[seq.seq_id] = copies
                seq.last_scheduled_step = step
                plan.budget -= num_new
        # pass 2: running prompts (chunked prefill, or recompute) get what budget is left
        for seq in prefilling:
            if seq.status is running and plan.budget > 0:
                num_new = min(len(seq.token_ids) - seq.num_computed_tokens, plan.budget)
                copies = allocate(seq.seq_id, seq.token_ids, num_new)
                if copies is None:
                    self._make_room(plan, seq, num_new)
                else:
                    take(seq, num_new, copies)
        if len(plan.num_new) < len(self.running):
            # least recently served first next time, so a small budget rotates over everyone
            self.running.sort(key=_served_key)
        if not plan.preempted:
            self._admit(plan)
        while not plan.num_new and self.waiting and self.running:
            # nothing could run: the running sequences wait for the rest of their group, which
            # waits for blocks. Free the least important one if it ranks below the queue's head.
            victim = max(self.running, key=_victim_key)
            head = self.waiting[0]
            if _queue_key(victim) < _queue_key(head) or not self._ready(head):
                break
            self.preempt(victim)
            plan.preempted.append(victim.seq_id)
            self._admit(plan)
        seqs = self.seqs
        block_ids = kv.block_ids  # no copy: the runner reads them before the tables change
        items = []
        for seq_id, num_new in scheduled.items():
            seq = seqs[seq_id]
            start = seq.num_computed_tokens
            verified = plan.drafts.get(seq_id)
            if verified is None:
                end = start + num_new
                items.append(ScheduledSeq(seq_id, seq.token_ids[start:end], start,
                                          block_ids(seq_id), end == len(seq.token_ids)))
            else:  # its last token, then the drafts (preempted victims never get here)
                items.append(ScheduledSeq(seq_id, seq.token_ids[start:] + verified, start,
                                          block_ids(seq_id), True, len(verified)))
        return SchedulerOutput(scheduled=tuple(items),
                               copy_ops=tuple(op for ops in plan.copy_ops.values() for op in ops),
                               preempted_ids=tuple(plan.preempted),
                               num_batched_tokens=sum(plan.num_new.values()))

    def _make_room(self, plan: _Plan, seq: Sequence, num_new: int) -> None:
        """Preempt victims (largest (priority, arrival) first) until `seq` gets its slots for
        `num_new` tokens, or is the victim itself."""
        while True:
            victim = max(self.running, key=_victim_key)
            plan.budget += plan.num_new.pop(victim.seq_id, 0)
            plan.copy_ops.pop(victim.seq_id, None)
            plan.drafts.pop(victim.seq_id, None)
            self.preempt(victim)
            plan.preempted.append(victim.seq_id)
            if victim is seq:
                return
            copies = self.kv.allocate_slots(seq.seq_id, seq.token_ids, num_new)
            if copies is not None:
                plan.take(seq, num_new, copies)
                return

    def _admit(self, plan: _Plan) -> None:
        """Waiting sequences start, in queue order, while budget, max_num_seqs and the pool
        allow (FCFS: nobody overtakes the head of the queue)."""
        kv = self.kv
        waiting = self.waiting
        i = 0  # the head, past sequences whose prefix is loading from a tier ...
        num_loading = 0  # ... which keep their places under max_num_seqs
        while i < len(waiting) and plan.budget > 0:
            seq = waiting[i]
            if (len(self.running) + self.num_pending_forks + num_loading + seq.num_seqs
                    > self.max_num_seqs):
                break
            if not self._ready(seq):
                num_loading += seq.num_seqs
                i += 1
                continue
            num_cached = kv.allocate_prefix(seq.seq_id, seq.token_ids, seq.cache_salt)
            assert num_cached < seq.num_tokens, "the last token is always recomputed"
            num_new = min(seq.num_tokens - num_cached, plan.budget)
            copies = kv.allocate_slots(seq.seq_id, seq.token_ids, num_new)
            if copies is None:
                kv.free(seq.seq_id)
                break
            del waiting[i]
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.num_pending_forks += seq.num_pending_forks
            plan.take(seq, num_new, copies)

    def _ready(self, seq: Sequence) -> bool:
        return self.tiers is None or self.tiers.ready(seq)

    def preempt(self, seq: Sequence, uncache: bool = False) -> None:
        """Send a running sequence back to waiting: its blocks are freed, its K/V recomputed
        (`uncache`: see KVCacheManager.free; the engine core rolls back a step launched on K/V
        that a failed step never wrote)."""
        assert seq.status is SequenceStatus.RUNNING
        if self.tiers is not None and not uncache:
            self.tiers.on_preempt(seq)
        self._release(seq, uncache, seq.num_computed_tokens)  # uncomputed blocks: uncached
        num_computed = seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        log.info("preempted", request_id=seq.request_id, seq_id=seq.seq_id, priority=seq.priority,
                 num_computed_tokens=num_computed, num_tokens=seq.num_tokens,
                 num_free_blocks=self.kv.num_free_blocks)

    def _release(self, seq: Sequence, uncache: bool = False,
                 num_computed: int | None = None) -> None:
        self.running.remove(seq)
        self.num_pending_forks -= seq.num_pending_forks
        self.kv.free(seq.seq_id, uncache, num_computed)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_queue_key)

    def advance(self, output: SchedulerOutput) -> None:
        """The scheduled tokens now have K/V in the cache: num_computed_tokens catches up."""
        seqs = self.seqs
        kv = self.kv
        window = kv.sliding_window is not None
        for item in output.scheduled:
            seq = seqs.get(item.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished while the step ran
            # draft tokens count once accepted (settle_drafts)
            seq.num_computed_tokens += len(item.token_ids) - item.num_draft_tokens
            if window:
                kv.release_outside_window(item.seq_id, seq.num_computed_tokens)

    def settle_drafts(self, seq_ids: Iterable[str]) -> None:
        """After a step verified these sequences' drafts and appended what it emitted: the
        accepted drafts' K/V counts (num_computed_tokens: all but the last token), the slots of
        the rejected ones return to the pool, and blocks now full of accepted tokens enter the
        prefix cache."""
        for seq_id in seq_ids:
            seq = self.seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished (its blocks are freed) or failed meanwhile
            num_computed = len(seq.token_ids) - 1
            assert num_computed >= seq.num_computed_tokens
            seq.num_computed_tokens = num_computed
            self.kv.truncate(seq_id, num_computed)
            self.kv.cache_blocks(seq_id, seq.token_ids)


@dataclass(slots=True)
class _Plan:
    """One step being scheduled: the tokens each sequence got (drafts included), its block
    copies, its preempted victims and its drafts, and what remains of the budget."""

    step: int
    budget: int
    num_new: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens this step
    copy_ops: dict[str, list[CopyOp]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)

    def take(self, seq: Sequence, num_new: int, copies: list[CopyOp]) -> None:
        self.num_new[seq.seq_id] = num_new
        if copies:
            self.copy_ops[seq.seq_id] = copies
        seq.last_scheduled_step = self.step
        self.budget -= num_new


def _victim_key(seq: Sequence) -> tuple[int, int, int]:
    # forks share their parent's arrival: the later index goes first
    return seq.priority, seq.arrival_seq, seq.index


_queue_key = _victim_key  # the waiting queue's order is the reverse of the victims'
_served_key = operator.attrgetter("last_scheduled_step")

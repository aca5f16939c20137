"""The int4 cache's fp16 window: which window slot holds each block's tokens in fp16 (the host's
bookkeeping, driven by KVCacheManager) and the ordered slot operations each step runs.

The rule of positions (what makes a request's tokens independent of timing): with W =
`window_blocks` (the window's tokens rounded up to whole blocks, at least one), the blocks of a
sequence form super-blocks of W; a query row reads the blocks of its own super-block in fp16
(their window slots) and every earlier block in its sealed int4 form (its rows), whichever step
wrote it, whether it was a prefix-cache hit, and however the rows were batched. The host keeps
what that rule reads valid:

- every block handed out for writing gets a slot (its tokens are written there in fp16); a
  block is "dirty" while its rows do not hold the quantized form of its slot;
- a sequence is a fp16 user of the blocks of its current super-block (from the super-block of
  its next row position on); a block's slot is given back once it has no user: sealed first
  (SEAL, before the next step's forward) if dirty and still held or cached, else just dropped;
- a step whose rows pass a super-block with dirty blocks seals them in that step, after its
  writes and before its attention (STEP_SEAL, every layer), where the kernels do that (the CPU
  path; `seal_in_step`): a prefill chunk crossing a super-block reads its earlier blocks both
  ways, the earlier rows in fp16 and the later ones sealed;
- a prefix hit ends on a super-block boundary (KVCacheManager), so a hit is only ever read
  sealed.

The GPU kernels read a block in fp16 while it holds a slot (they do not seal within a step):
the same data, with no promise about which form a row sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

# one slot operation, (kind, a, b); executed in order, before the step's forward pass
WindowOp = tuple[int, int, int]
ASSIGN = 0  # (block_id, slot): the block's tokens live in the slot from now on
SEAL = 1  # (block_id, slot): quantize the slot into the block's rows, then drop the slot
COPY = 2  # (src_slot, dst_slot): copy-on-write of an open block's tokens
RELEASE = 3  # (block_id, slot): the block no longer names the slot (rows valid, or dead)
# (block_id, slot): quantize the slot into the block's rows in this step's forward, after its
# writes and before its attention (every layer); the block keeps its slot
STEP_SEAL = 4


def window_blocks(window_tokens: int, block_size: int) -> int:
    """Blocks per super-block: the window's tokens rounded up to whole blocks, at least one
    (a row's own block is always read in fp16: a partial block cannot be sealed)."""
    return max(1, math.ceil(window_tokens / block_size))


def num_window_slots(max_num_seqs: int, window_tokens: int, block_size: int,
                     max_num_batched_tokens: int) -> int:
    """The window's blocks: each running sequence's current super-block (window_blocks W)
    plus one, and the blocks one step's max_num_batched_tokens open. That is enough: a
    sequence's slots when a step is scheduled are its super-block's (at most W) and the
    step's new blocks (at most its tokens / bs + 1); the slots of blocks behind every user's
    super-block are given back when the step before is launched. Forks count in
    max_num_seqs; a shortage anyway is met like a shortage of blocks (preemption)."""
    for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value <= 0:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if window_tokens < 0:
        raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
    per_seq = window_blocks(window_tokens, block_size) + 1
    return max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / block_size)


class WindowSlots:
    """Host bookkeeping of the window slots: the slot of each block that holds one, which
    blocks are dirty (rows stale), each block's fp16 users, the free slots, and the operations
    recorded since the last step took them."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int,
                 window_tokens: int, seal_in_step: bool = True) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
        self.num_slots, self.block_size, self.window_tokens = num_slots, block_size, window_tokens
        self.window_blocks = window_blocks(window_tokens, block_size)
        self.seal_in_step = seal_in_step  # the kernels seal within a step (STEP_SEAL)
        self.slot_of: list[int | None] = [None] * num_blocks  # None: no slot (rows only)
        self.dirty = [False] * num_blocks  # the rows do not hold the slot's quantized tokens
        self.users = [0] * num_blocks  # sequences that may still read the block in fp16
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._ops: list[WindowOp] = []
        self._step_seals: list[WindowOp] = []  # the launched step's, from the launch pass
        # the cache manager's pass over its sequences, run when a step takes its operations
        # (the step's in-step seals, the slots its sequences no longer read)
        self.on_take: Callable[[], None] | None = None
        self.num_shortages = 0  # allocations refused for want of a slot (sized to stay 0)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def open(self, block_id: int) -> None:
        """A block handed out for writing: give it a slot; its writer is its one fp16 user."""
        assert self.slot_of[block_id] is None, f"block {block_id} is already open"
        slot = self._free.pop()
        self.slot_of[block_id] = slot
        self.dirty[block_id] = True
        self.users[block_id] = 1
        self._ops.append((ASSIGN, block_id, slot))

    def copy(self, src_block: int, dst_block: int) -> None:
        """Copy-on-write of a block's tokens into a just opened one."""
        src, dst = self.slot_of[src_block], self.slot_of[dst_block]
        assert src is not None and dst is not None, "copy-on-write of a block without a slot"
        self._ops.append((COPY, src, dst))

    def written(self, block_id: int) -> None:
        """The step being scheduled writes tokens of this block (its slot)."""
        assert self.slot_of[block_id] is not None, f"a write into block {block_id} without a slot"
        self.dirty[block_id] = True

    def step_seal(self, block_id: int) -> None:
        """Rows of the step being launched read this block sealed: seal it in the step if
        its rows are stale (no-op otherwise, or where the kernels do not seal in steps)."""
        slot = self.slot_of[block_id]
        if self.seal_in_step and slot is not None and self.dirty[block_id]:
            self._step_seals.append((STEP_SEAL, block_id, slot))
            self.dirty[block_id] = False

    def add_user(self, block_id: int) -> None:
        assert self.slot_of[block_id] is not None, f"block {block_id} has no slot to read"
        self.users[block_id] += 1

    def drop_user(self, block_id: int, held: bool, cached: bool) -> None:
        """A sequence no longer reads the block in fp16; at the last user the slot is given
        back (`held`: some sequence still holds the block; `cached`: it is in the prefix
        cache)."""
        assert self.users[block_id] > 0, f"block {block_id} has no fp16 user to drop"
        self.users[block_id] -= 1
        if self.users[block_id] == 0:
            self.give_back(block_id, keep_rows=held or cached)

    def dropped(self, block: Any, user: bool) -> None:
        """A sequence dropped its reference to a pool block (`user`: it was one of the block's
        fp16 users): the slot goes back once no sequence reads the block in fp16, sealed if
        the block stays readable (held by others or in the prefix cache)."""
        cached = block.block_hash is not None
        if user:
            self.drop_user(block.block_id, held=block.ref_count > 0, cached=cached)
        elif block.ref_count == 0:
            self.give_back(block.block_id, keep_rows=cached)

    def give_back(self, block_id: int, keep_rows: bool) -> None:
        """Free the block's slot (no-op without one): its rows are sealed first if they are
        to be read (`keep_rows`) and stale; otherwise its data is just dropped."""
        slot = self.slot_of[block_id]
        if slot is None:
            return
        assert self.users[block_id] == 0, f"block {block_id} still has fp16 users"
        self._ops.append((SEAL if keep_rows and self.dirty[block_id] else RELEASE, block_id,
                          slot))
        self._free.append(slot)
        self.slot_of[block_id] = None
        self.dirty[block_id] = False

    def take_ops(self) -> list[WindowOp]:
        """The operations for the step being launched: everything recorded since the last
        take, then the in-step seals of the manager's launch pass; the slots the pass gives
        back (rows its sequences' next rows no longer read in fp16) go into the next step's
        operations (this step may still write and read them)."""
        ops, self._ops = self._ops, []
        if self.on_take is not None:
            self.on_take()
        step_seals, self._step_seals = self._step_seals, []
        return ops + step_seals

    def num_open_blocks(self) -> int:
        return sum(slot is not None for slot in self.slot_of)


class WindowedSequence(Protocol):
    """What the launch pass reads of a sequence of the cache manager."""

    blocks: list[Any]  # the block table (Block or None: released by a sliding window)
    num_tokens: int  # tokens with a slot (the step's drafts included)
    num_scheduled: int  # tokens the steps scheduled so far write (drafts excluded)
    num_written: int  # of those, the tokens of the steps already launched
    num_clean: int  # leading blocks the in-step seal pass has been through
    fp16_start: int  # blocks from here on: this sequence is one of their fp16 users


def launch_pass(window: WindowSlots, seqs: Iterable[WindowedSequence], block_size: int) -> None:
    """When a step is launched, for every sequence: the dirty blocks behind the super-block
    of its last row are sealed in the step (its later rows read them sealed); its launched
    tokens count as written; it stops being a fp16 user of the blocks behind the super-block
    of its next row (their slots go back once no user is left)."""
    span = window.window_blocks * block_size  # tokens per super-block
    for seq in seqs:
        if seq.num_tokens:
            cut = (seq.num_tokens - 1) // span * window.window_blocks
            for block in seq.blocks[seq.num_clean:cut]:
                if block is not None:
                    window.step_seal(block.block_id)
            seq.num_clean = max(seq.num_clean, cut)
        seq.num_written = seq.num_scheduled
        start = min(seq.num_written // span * window.window_blocks, len(seq.blocks))
        for block in seq.blocks[seq.fp16_start:start]:
            if block is not None:
                window.drop_user(block.block_id, held=block.ref_count > 0,
                                 cached=block.block_hash is not None)
        seq.fp16_start = max(seq.fp16_start, start)


def batch_window_ops(ops: Iterable[WindowOp]
                     ) -> tuple[list[tuple[int, list[tuple[int, int]]]], dict[int, int],
                                list[tuple[int, int]]]:
    """Operations in order -> (stages, table, step seals): stages run in order, each (SEAL,
    [(block_id, slot)]) or (COPY, [(src_slot, dst_slot)]), consecutive operations of one kind
    merged into one launch while they cannot see each other's writes; table: each touched
    block's final window_slot value (-1: sealed or released). Seals and copies name their
    slots, so the table is written once, after them. Step seals: the (block_id, slot) pairs
    the step's forward seals after its writes."""
    stages: list[tuple[int, list[tuple[int, int]]]] = []
    table: dict[int, int] = {}
    step_seals: list[tuple[int, int]] = []
    for kind, a, b in ops:
        if kind == STEP_SEAL:
            step_seals.append((a, b))
            continue
        if kind == ASSIGN:
            table[a] = b
            continue
        if kind == RELEASE:
            table[a] = -1
            continue
        stage = stages[-1][1] if stages and stages[-1][0] == kind else None
        if kind == SEAL:
            table[a] = -1
            if stage is not None and any(block_id == a for block_id, _ in stage):
                stage = None  # a block sealed twice: the second seal runs after the first
        else:
            assert kind == COPY, f"unknown window operation {kind}"
            # a copy reading or overwriting a slot another copy of the stage writes waits
            if stage is not None and any(a == dst or b in (src, dst) for src, dst in stage):
                stage = None
        if stage is None:
            stage = []
            stages.append((kind, stage))
        stage.append((a, b))
    return stages, table, step_seals

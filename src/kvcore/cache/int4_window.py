"""The int4 cache's fp16 window of recent tokens: which window slot holds each open block (the
host's bookkeeping, driven by KVCacheManager) and the ordered slot operations each step runs
before its forward pass (KVCache.apply_window_ops).

A block is open while its tokens may still be written or rolled back: every block handed out
for writing gets a slot, and its tokens go there in fp16. It is sealed (quantized into its int4
rows in every layer, its slot freed) once the tokens scheduled for its sequence pass its end by
`window_tokens`, so a speculative draft (never counted) can never need a sealed block back; when
its last reference drops while it is in the prefix cache; or early, when an allocation finds no
free slot and its tokens are all written. An uncached block whose last reference drops just gives
its slot back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Protocol

# one slot operation, (kind, a, b); executed in order, before the step's forward pass
WindowOp = tuple[int, int, int]
ASSIGN = 0  # (block_id, slot): the block's tokens live in the slot from now on
SEAL = 1  # (block_id, slot): quantize the slot into the block's rows; the block reads its rows
COPY = 2  # (src_slot, dst_slot): copy-on-write of an open block's tokens
RELEASE = 3  # (block_id, slot): the block's data is dead; it no longer names the slot


def num_window_slots(max_num_seqs: int, window_tokens: int, block_size: int,
                     max_num_batched_tokens: int) -> int:
    """The window's blocks: each running sequence's last ceil(R / bs) + 1 blocks (its window
    and its partial last block, at least 2) and the blocks one step's max_num_batched_tokens
    open. That is never too few: open blocks whose tokens are all written can always be
    sealed early (KVCacheManager seals them when an allocation is short of slots, shrinking
    the window under pressure), and what cannot be sealed, each sequence's blocks from its
    last written token to the end of this step's tokens (drafts included), is below
    2 x max_num_seqs + max_num_batched_tokens / bs blocks. Forks count in max_num_seqs."""
    for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value <= 0:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if window_tokens < 0:
        raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
    per_seq = max(math.ceil(window_tokens / block_size) + 1, 2)
    return max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / block_size)


class WindowSlots:
    """Host bookkeeping of the window slots: the slot of each open block, the free slots, and
    the operations recorded since the last step took them."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int,
                 window_tokens: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
        self.num_slots, self.block_size, self.window_tokens = num_slots, block_size, window_tokens
        self.slot_of: list[int | None] = [None] * num_blocks  # None: sealed or never written
        self._free = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 is handed out first
        self._ops: list[WindowOp] = []
        # the cache manager's seal pass, run when a step takes its operations (the tokens it
        # scheduled are written before the next step's operations run)
        self.on_take: Callable[[], None] | None = None
        self.num_shortages = 0  # allocations refused for want of a slot (sized to stay 0)
        self.num_early_seals = 0  # blocks sealed inside the window for want of a slot

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def open(self, block_id: int) -> None:
        """A block handed out for writing: give it a slot."""
        assert self.slot_of[block_id] is None, f"block {block_id} is already open"
        slot = self._free.pop()
        self.slot_of[block_id] = slot
        self._ops.append((ASSIGN, block_id, slot))

    def copy(self, src_block: int, dst_block: int) -> None:
        """Copy-on-write of an open block into a just opened one."""
        src, dst = self.slot_of[src_block], self.slot_of[dst_block]
        assert src is not None and dst is not None, "copy-on-write of a sealed block"
        self._ops.append((COPY, src, dst))

    def seal(self, block_id: int) -> None:
        """Quantize an open block into its rows and free its slot (no-op if sealed)."""
        slot = self.slot_of[block_id]
        if slot is not None:
            self._ops.append((SEAL, block_id, slot))
            self._free.append(slot)
            self.slot_of[block_id] = None

    def retire(self, block_id: int, cached: bool) -> None:
        """The block's last reference dropped: sealed if the prefix cache keeps it (a later
        hit reads it, self-contained), else its slot is just freed."""
        slot = self.slot_of[block_id]
        if slot is None:
            return
        if cached:
            self.seal(block_id)
        else:
            self._ops.append((RELEASE, block_id, slot))
            self._free.append(slot)
            self.slot_of[block_id] = None

    def take_ops(self) -> list[WindowOp]:
        """The operations for the step being launched (everything recorded since the last
        take), then the seal pass for the tokens it writes (into the next step's operations)."""
        ops, self._ops = self._ops, []
        if self.on_take is not None:
            self.on_take()
        return ops

    def num_open_blocks(self) -> int:
        return sum(slot is not None for slot in self.slot_of)


class WindowedSequence(Protocol):
    """What the seal passes read of a sequence of the cache manager."""

    block_ids: list[int | None]  # the block table (None: released by a sliding window)
    num_scheduled: int  # tokens the steps scheduled so far write (drafts excluded)
    num_written: int  # of those, the tokens of the steps already launched
    num_sealed: int  # leading blocks the seal pass has been through


def seal_behind_window(window: WindowSlots, seqs: Iterable[WindowedSequence],
                       block_size: int) -> None:
    """When a step is launched: its tokens count as written, and every open block that ends
    at least window_tokens before a sequence's written tokens is sealed (next step)."""
    for seq in seqs:
        seq.num_written = seq.num_scheduled
        limit = (seq.num_written - window.window_tokens) // block_size  # blocks ending by then
        for block_id in seq.block_ids[seq.num_sealed:limit]:
            if block_id is not None:
                window.seal(block_id)
        seq.num_sealed = max(seq.num_sealed, limit)


def seal_early(window: WindowSlots, seqs: Iterable[WindowedSequence], block_size: int,
               num_needed: int) -> None:
    """Short of slots: seal open blocks whose tokens the launched steps all wrote, even inside
    the window, until num_needed slots are free (the window shrinks under pressure rather than
    an allocation failing; never a block that may still hold a draft)."""
    for seq in seqs:
        for block_id in seq.block_ids[seq.num_sealed:seq.num_written // block_size]:
            if window.num_free_slots >= num_needed:
                return
            if block_id is not None and window.slot_of[block_id] is not None:
                window.seal(block_id)
                window.num_early_seals += 1


def batch_window_ops(ops: Iterable[WindowOp]
                     ) -> tuple[list[tuple[int, list[tuple[int, int]]]], dict[int, int]]:
    """Operations in order -> (stages, table): stages run in order, each (SEAL, [(block_id,
    slot)]) or (COPY, [(src_slot, dst_slot)]), consecutive operations of one kind merged into
    one launch while they cannot see each other's writes; table: each touched block's final
    window_slot value (-1: sealed or released). Seals and copies name their slots, so the
    table is written once, after them."""
    stages: list[tuple[int, list[tuple[int, int]]]] = []
    table: dict[int, int] = {}
    for kind, a, b in ops:
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
    return stages, table

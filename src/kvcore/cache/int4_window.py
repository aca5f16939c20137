"""The int4 cache's fp16 window of recent tokens: which window slot holds each open block (the
host's bookkeeping, driven by KVCacheManager) and the ordered slot operations each step runs
before its forward pass (KVCache.apply_window_ops).

A block is open while its tokens may still be written or rolled back: every block handed out
for writing gets a slot, and its tokens go there in fp16. It is sealed (quantized into its int4
rows in every layer, its slot freed) once the tokens scheduled for its sequence pass its end by
`window_tokens`, so a speculative draft (never counted) can never need a sealed block back; and
when its last reference drops while it is in the prefix cache. An uncached block whose last
reference drops just gives its slot back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# one slot operation, (kind, a, b); executed in order, before the step's forward pass
WindowOp = tuple[int, int, int]
ASSIGN = 0  # (block_id, slot): the block's tokens live in the slot from now on
SEAL = 1  # (block_id, slot): quantize the slot into the block's rows; the block reads its rows
COPY = 2  # (src_slot, dst_slot): copy-on-write of an open block's tokens
RELEASE = 3  # (block_id, slot): the block's data is dead; it no longer names the slot


def num_window_slots(max_num_seqs: int, window_tokens: int, block_size: int,
                     max_num_batched_tokens: int) -> int:
    """Slots enough that the window never runs out. Between two steps a running sequence's
    open blocks are those from floor((scheduled - R) / bs) to its last block, where scheduled
    counts the tokens of the steps launched so far: at most ceil(R / bs) + 2 blocks plus
    ceil(n / bs) for the n tokens (drafts included) the next step schedules for it; the n add
    up to at most max_num_batched_tokens. Forks count in max_num_seqs, and a shared open block
    is counted once per holder, so the sum bounds the distinct open blocks."""
    for name, value in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if value <= 0:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if window_tokens < 0:
        raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
    per_seq = math.ceil(window_tokens / block_size) + 2
    return max_num_seqs * (per_seq + 1) + math.ceil(max_num_batched_tokens / block_size)


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

"""KVCacheManager: per-sequence block tables over a BlockPool (prefix hits, fork, copy-on-write)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvcore.cache.block_pool import Block, BlockPool, salt_key
from kvcore.cache.int4_window import WindowSlots, launch_pass
from kvcore.cache.seq_blocks import SeqBlocks

CopyOp = tuple[int, int]  # (src_block_id, dst_block_id), executed by the runner before forward
# a token sampled on the device whose id the host does not know yet (async scheduling): only ever
# the last token of a sequence; a block holding it is hashed later, by `cache_blocks`
PENDING_TOKEN_ID = -1


class Admission(enum.Enum):
    OK = "ok"  # the blocks are free now
    NOT_NOW = "not_now"  # fits the pool, but not enough blocks are free yet
    NEVER = "never"  # needs more blocks than the whole pool holds


class KVCacheManager:
    """Block tables of the running sequences over one BlockPool.

    A sequence starts with `allocate_prefix` (cached full blocks of its prompt) and grows with
    `allocate_slots`. Only full blocks enter the prefix cache, under the chain hash
    H(parent hash, token ids, extra keys) whose only extra key is the salt of the first block. A
    block whose refcount is above 1 is never written: appending to a shared, partially filled last
    block first copies it, and the copy is returned as a `(src, dst)` op for the runner.

    With a sliding window, prefix caching is disabled: blocks outside the window are released as the
    sequence grows, so a cached prefix would not hold the K/V a later prompt needs.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and (not isinstance(sliding_window, int)
                                           or sliding_window <= 0):
            raise ValueError(
                f"sliding_window must be a positive integer or None, got {sliding_window!r}")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching and sliding_window is None
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens served from cached blocks
        self.num_cow_copies = 0  # copy-on-write block copies handed to the runner
        self._seqs: dict[str, SeqBlocks] = {}
        self.window: WindowSlots | None = None  # an int4 cache's fp16 window (attach_window)

    def attach_window(self, window: WindowSlots) -> None:
        """Drive an int4 cache's window slots (kvcore.cache.int4_window's rule of positions):
        open a block handed out for writing, copy it on copy-on-write, mark the blocks a step
        writes, and at each launch seal in the step what its rows read sealed and give back
        the slots that no sequence reads in fp16 any more."""
        self.window = window
        window.on_take = lambda: launch_pass(window, self._seqs.values(), self.block_size)

    def _drop(self, block: Block, user: bool = False) -> None:
        """One reference less (`user`: the sequence was one of the block's fp16 users)."""
        self.pool.free(block)
        if self.window is not None:
            self.window.dropped(block, user)

    def _user(self, seq: SeqBlocks, index: int) -> bool:
        """Whether the sequence is a fp16 user of its block `index` (an int4 cache)."""
        return self.window is not None and index >= seq.fp16_start

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_prefix(self, seq_id: str, token_ids: Sequence[int],
                        salt: str | None = None) -> int:
        """Start a sequence: attach the longest cached prefix of full blocks of `token_ids` and
        return num_cached_tokens, a multiple of block_size and at most len(token_ids) - 1, so the
        last prompt token is always recomputed (its logits are needed) and no shared block is
        written. No new block is allocated here; `allocate_slots` does that."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id {seq_id!r} is already allocated")
        num_prompt = len(token_ids)
        if num_prompt == 0:
            raise ValueError(f"token_ids of seq_id {seq_id!r} must not be empty")
        seq = SeqBlocks(salt_key(salt))
        self._seqs[seq_id] = seq
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        blocks, seq.block_hashes = self.pool.match_prefix(token_ids, (num_prompt - 1) // bs,
                                                          seq.salt)
        if self.window is not None:  # whole super-blocks only: a hit is only ever read sealed
            keep = len(blocks) // self.window.window_blocks * self.window.window_blocks
            blocks, seq.block_hashes = blocks[:keep], seq.block_hashes[:keep]
        touch = self.pool.touch
        for block in blocks:
            touch(block)
        seq.blocks = list(blocks)
        seq.block_ids = [block.block_id for block in blocks]
        seq.num_tokens = num_cached = len(seq.blocks) * bs
        seq.fp16_start = len(seq.blocks)
        self.num_prefix_queries += num_prompt
        self.num_prefix_hits += num_cached
        return num_cached

    def allocate_slots(self, seq_id: str, token_ids: Sequence[int], num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[CopyOp] | None:
        """Make room for num_new_tokens more tokens; `token_ids` is the sequence's whole token list
        (at least num_tokens + num_new_tokens long) so blocks that become full get their hash.
        `num_lookahead_tokens`: slots for draft tokens past the end of `token_ids` (speculative
        decoding); a block holding one is not hashed (`cache_blocks` does it once the tokens
        are accepted) and `truncate` returns the slots of rejected ones. Returns the
        copy-on-write ops, or None (with no side effect) when the pool is short."""
        seq = self._seqs[seq_id]
        start = seq.num_tokens
        if num_lookahead_tokens:
            if num_lookahead_tokens < 0 or len(token_ids) != start + num_new_tokens:
                raise ValueError(f"num_lookahead_tokens ({num_lookahead_tokens}) must be >= 0 "
                                 f"and follow every token of seq_id {seq_id!r}")
            ops = self._grow(seq, token_ids, start, start + num_new_tokens
                             + num_lookahead_tokens)
            if ops is not None:
                seq.num_scheduled = start + num_new_tokens
            return ops
        end = start + num_new_tokens
        blocks = seq.blocks
        if num_new_tokens > 0 and end <= len(token_ids) and end < len(blocks) * self.block_size:
            last = blocks[-1]
            if last is not None and last.ref_count == 1:
                # the common decode step: room left in an exclusively owned last block that does
                # not fill up, so nothing to allocate, copy or hash
                seq.num_tokens = seq.num_scheduled = end
                if self.window is not None:
                    self.window.written(last.block_id)
                return []
        if num_new_tokens <= 0:
            if num_new_tokens == 0:
                return []
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if len(token_ids) < end:
            raise ValueError(f"token_ids of seq_id {seq_id!r} has {len(token_ids)} tokens; "
                             f"{start} allocated + {num_new_tokens} new need at least {end}")
        ops = self._grow(seq, token_ids, start, end)
        if ops is not None:
            seq.num_scheduled = end
        return ops

    def _grow(self, seq: SeqBlocks, token_ids: Sequence[int], start: int,
              end: int) -> list[CopyOp] | None:
        bs = self.block_size
        blocks = seq.blocks
        num_new_blocks = -(-end // bs) - len(blocks)
        last = blocks[-1] if start % bs else None  # a partially filled last block gets written
        copy = last is not None and last.ref_count > 1
        num_alloc = num_new_blocks + (1 if copy else 0)
        window = self.window
        if window is not None and window.num_free_slots < num_alloc:
            window.num_shortages += 1  # as short of blocks: preemption frees some
            return None
        new = self.pool.allocate(num_alloc)
        if new is None:
            return None
        if window is not None:
            for block in new:
                window.open(block.block_id)  # its writer (this sequence) is its fp16 user
        ops: list[CopyOp] = []
        if copy:
            assert last is not None
            dst = new[0]  # the copy takes the first block allocated, the new tail blocks follow
            ops.append((last.block_id, dst.block_id))
            if window is not None:
                window.copy(last.block_id, dst.block_id)
            self.num_cow_copies += 1
            # one reference less; the other holders keep the original
            self._drop(last, self._user(seq, len(blocks) - 1))
            blocks[-1] = dst
            seq.block_ids[-1] = dst.block_id
            blocks.extend(new[1:])
            seq.block_ids.extend(block.block_id for block in new[1:])
        else:
            blocks.extend(new)
            seq.block_ids.extend(block.block_id for block in new)
        written = blocks[start // bs]
        assert written is not None and written.ref_count == 1, "write into a shared block"
        if window is not None:
            for held in blocks[start // bs:-(-end // bs)]:
                assert held is not None
                window.written(held.block_id)
        seq.num_tokens = end
        known = min(end, len(token_ids))  # past it: draft tokens, hashed once accepted
        num_full = known // bs
        if known == len(token_ids) and token_ids[known - 1] == PENDING_TOKEN_ID:
            num_full = (known - 1) // bs  # its hash needs the token: cache_blocks, once known
        if self.enable_prefix_caching and num_full > len(seq.block_hashes):
            self.pool.cache_full_blocks(blocks, seq.block_hashes, token_ids, num_full, seq.salt)
        return ops

    def cache_blocks(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Hash the full blocks whose hash waited for a pending token that is now known (its id
        replaced PENDING_TOKEN_ID in `token_ids`, the sequence's whole token list)."""
        seq = self._seqs[seq_id]
        num_full = min(len(token_ids), seq.num_tokens) // self.block_size
        if self.enable_prefix_caching and num_full > len(seq.block_hashes):
            assert PENDING_TOKEN_ID not in token_ids[len(seq.block_hashes) * self.block_size:
                                                     num_full * self.block_size]
            self.pool.cache_full_blocks(seq.blocks, seq.block_hashes, token_ids, num_full,
                                        seq.salt)

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Keep the first num_tokens slots (the rest held rejected draft tokens): the blocks
        past them return to the pool. A kept block is never hashed past num_tokens, so a
        returned one was never in the prefix cache."""
        seq = self._seqs[seq_id]
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {seq.num_tokens}] for seq_id "
                             f"{seq_id!r}, got {num_tokens}")
        num_blocks = -(-num_tokens // self.block_size)
        assert len(seq.block_hashes) <= num_blocks, "a hashed block holds a draft token"
        window = self.window
        if window is not None:  # drafts never count as written: the next row still reads fp16
            span = window.window_blocks * self.block_size
            assert num_tokens // span * window.window_blocks >= seq.fp16_start, \
                "a rollback behind the fp16 window"
        while len(seq.blocks) > num_blocks:
            block = seq.blocks.pop()
            seq.block_ids.pop()
            if block is not None:
                self._drop(block, self._user(seq, len(seq.blocks)))
        seq.num_tokens = num_tokens
        seq.num_scheduled = min(seq.num_scheduled, num_tokens)
        seq.num_written = min(seq.num_written, num_tokens)
        seq.num_clean = min(seq.num_clean, num_tokens // self.block_size)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (refcount + 1); writes copy on demand."""
        parent = self._seqs[parent_id]
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} is already allocated")
        child = SeqBlocks(parent.salt)
        child.blocks = list(parent.blocks)
        child.block_ids = list(parent.block_ids)
        child.num_tokens = parent.num_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_released = parent.num_released
        child.num_scheduled, child.num_written = parent.num_scheduled, parent.num_written
        child.num_clean, child.fp16_start = parent.num_clean, parent.fp16_start
        for i, block in enumerate(child.blocks):
            if block is not None:
                block.ref_count += 1
                if self._user(child, i):
                    assert self.window is not None
                    self.window.add_user(block.block_id)
        self._seqs[child_id] = child

    def free(self, seq_id: str, uncache: bool = False, num_computed: int | None = None) -> None:
        """Drop the sequence's references; an unknown seq_id raises KeyError. `uncache`: blocks
        that no other sequence holds also leave the prefix cache (a failed forward pass may have
        left them hashed but never written); so do those past `num_computed` tokens (a
        preempted sequence's blocks hashed for a step it no longer runs in)."""
        seq = self._seqs.pop(seq_id)
        pool = self.pool
        first_dirty = 0 if uncache else (len(seq.blocks) if num_computed is None
                                         else num_computed // self.block_size)
        # free in reverse so the tail block is evicted first: a later prompt sharing a prefix
        # needs the head blocks, and a hit on block i is useless without blocks 0..i-1
        for i in range(len(seq.blocks) - 1, -1, -1):
            block = seq.blocks[i]
            if block is None:
                continue
            if i >= first_dirty and block.ref_count == 1:
                pool.uncache(block)
            self._drop(block, self._user(seq, i))

    def release_outside_window(self, seq_id: str, num_computed_tokens: int) -> None:
        """Free the blocks whose every position is <= num_computed_tokens - sliding_window: the next
        query sits at position num_computed_tokens or later and attends only positions above that.
        The block table keeps None in their place. No-op without a sliding window."""
        seq = self._seqs[seq_id]
        if not 0 <= num_computed_tokens <= seq.num_tokens:
            raise ValueError(f"num_computed_tokens must be in [0, {seq.num_tokens}] for seq_id "
                             f"{seq_id!r}, got {num_computed_tokens}")
        if self.sliding_window is None:
            return
        # block i spans positions [i*bs, (i+1)*bs - 1]; it is out when (i+1)*bs - 1 <= limit.
        # Such a block is full (num_computed_tokens <= num_tokens), so it is never written again.
        limit = num_computed_tokens - self.sliding_window
        num_out = (limit + 1) // self.block_size if limit >= 0 else 0
        for i in range(seq.num_released, num_out):
            block = seq.blocks[i]
            assert block is not None
            self._drop(block, self._user(seq, i))
            seq.blocks[i] = None
            seq.block_ids[i] = None
        seq.num_released = max(seq.num_released, num_out)

    def block_table(self, seq_id: str) -> list[int | None]:
        """Block ids of the sequence in position order (a copy); None = released by the window."""
        return list(self._seqs[seq_id].block_ids)

    def block_ids(self, seq_id: str) -> list[int | None]:
        """block_table without the copy: the manager's own list, valid until the sequence's
        table changes (the next allocate_slots, release or free). Read it, never modify it."""
        return self._seqs[seq_id].block_ids

    def num_tokens(self, seq_id: str) -> int:
        return self._seqs[seq_id].num_tokens

    def slot(self, seq_id: str, position: int) -> int:
        """The KV slot of a position: block_id * block_size + offset in the block."""
        seq = self._seqs[seq_id]
        if not 0 <= position < seq.num_tokens:
            raise ValueError(f"position must be in [0, {seq.num_tokens}) for seq_id {seq_id!r}, "
                             f"got {position}")
        block = seq.blocks[position // self.block_size]
        if block is None:
            raise ValueError(f"position {position} of seq_id {seq_id!r} was released (outside "
                             f"the sliding window)")
        return block.block_id * self.block_size + position % self.block_size

    def admission(self, num_tokens: int) -> Admission:
        """Whether a new sequence of num_tokens tokens fits: now, later, or never."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        num_needed = -(-num_tokens // self.block_size)
        if num_needed > self.num_blocks:
            return Admission.NEVER
        if num_needed > self.pool.num_free_blocks:
            return Admission.NOT_NOW
        return Admission.OK

    def usage(self) -> float:
        """Fraction of the blocks referenced by some sequence."""
        return (self.num_blocks - self.pool.num_free_blocks) / self.num_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after new weights); running sequences are untouched."""
        self.pool.reset_prefix_cache()

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[str]:
        return list(self._seqs)

"""The block pool: fixed KV blocks, refcounts, an LRU free queue and the prefix-hash map."""

from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Callable, Sequence

BlockHash = bytes  # a sha256 digest of (parent hash, token ids, extra keys)
# a prefix-cache change for subscribers (the cluster router): (True, hash) = the hash became
# findable, (False, hash) = it was evicted or uncached
CacheEvent = tuple[bool, BlockHash]


class Block:
    """One KV block's bookkeeping record; the K/V data lives in KVCache under the same block_id."""

    __slots__ = ("block_id", "ref_count", "block_hash", "token_bytes", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id  # index into every layer's cache tensor
        self.ref_count = 0  # block tables that hold this block; 0 = in the free queue
        # chain hash of a full block registered in the prefix cache; None while partial or uncached
        self.block_hash: BlockHash | None = None
        # token ids of a full cached block, packed as little-endian int64; every prefix hit compares
        # them, so a hash collision can never serve another prompt's K/V
        self.token_bytes: bytes | None = None
        # neighbours in the free queue (intrusive doubly-linked list: O(1) removal from the middle)
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"Block(id={self.block_id}, ref_count={self.ref_count}, cached={cached})"


def hash_block(parent: BlockHash | None, token_bytes: bytes, extra: bytes = b"") -> BlockHash:
    """Chain hash H(parent hash, token ids, extra keys).

    Every field but the last has a fixed length for a given block size (32-byte parent, absent for
    the first block; 8 bytes per token), so the concatenation is unambiguous.
    """
    return hashlib.sha256((parent or b"") + token_bytes + extra).digest()


def salt_key(salt: str | None) -> bytes:
    """The first block's extra key for a tenant's cache salt (b"" without one); the tag byte keeps
    a salted chain from ever equalling an unsalted one."""
    return b"" if salt is None else b"\x01" + salt.encode()


def chain_hashes(token_ids: Sequence[int], block_size: int, salt: str | None,
                 max_blocks: int | None = None) -> list[BlockHash]:
    """The chain hashes of the full blocks of token_ids (at most max_blocks), exactly as the pool
    names them: what a router outside the engine computes to ask which replica holds a prompt."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    pack = struct.Struct(f"<{block_size}q").pack
    extra = salt_key(salt)
    hashes: list[BlockHash] = []
    parent = b""
    for start in range(0, num_full * block_size, block_size):
        parent = hash_block(parent, pack(*token_ids[start:start + block_size]), extra)
        hashes.append(parent)
        extra = b""
    return hashes


class BlockPool:
    """A fixed number of blocks with refcounts, a free queue in LRU order and a prefix-hash map.

    Blocks whose refcount drops to 0 go to the tail of the free queue; allocation takes the head,
    so the least recently freed block is reused (and its prefix-cache entry evicted) first. A freed
    block that has a hash stays findable until that happens; a prefix hit takes it out of the middle
    of the queue in O(1).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # sentinels bracket the free queue so link and unlink never branch; never handed out
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        for block in self.blocks:
            self._append_free(block)
        self.num_free_blocks = num_blocks
        self.cached: dict[BlockHash, Block] = {}  # prefix cache: chain hash -> the block holding it
        self._pack = struct.Struct(f"<{block_size}q").pack  # token ids of one block -> bytes
        # prefix-cache changes since the last drain, or None while nobody subscribes (no cost);
        # a deque because the engine step (a worker thread) appends while the event loop drains
        self._events: deque[CacheEvent] | None = None
        # the KV tiers' hooks (None: no tier): a cached block about to be reused, with its
        # hash and token bytes (its data is intact until the step that reuses it writes it),
        # and a block that just entered the prefix cache
        self.on_evict: Callable[[Block, BlockHash, bytes], None] | None = None
        self.on_cache: Callable[[Block], None] | None = None

    def enable_events(self) -> None:
        """Start recording prefix-cache changes (hashes cached / evicted) for `drain_events`."""
        if self._events is None:
            self._events = deque((True, h) for h in self.cached)

    def drain_events(self) -> list[CacheEvent]:
        """The changes recorded since the last drain, oldest first (empty while disabled).
        Safe to call from another thread than the one running the engine step."""
        events = self._events
        out: list[CacheEvent] = []
        if events is None:
            return out
        pop = events.popleft
        while events:
            out.append(pop())
        return out

    def pack_tokens(self, token_ids: Sequence[int]) -> bytes:
        """The compact encoding of one full block's token ids (hashed, and kept for comparison)."""
        return self._pack(*token_ids)

    def allocate(self, num_blocks: int) -> list[Block] | None:
        """Take num_blocks blocks from the head of the free queue (ref_count 1), evicting their
        prefix-cache entries; all or nothing: None, with no side effect, when fewer are free."""
        if num_blocks > self.num_free_blocks:
            return None
        head = self._head
        cached = self.cached
        out = []
        for _ in range(num_blocks):
            block = head.next_free
            assert block is not None and block.ref_count == 0
            after = block.next_free
            assert after is not None
            head.next_free = after
            after.prev_free = head
            block.prev_free = block.next_free = None
            if block.block_hash is not None:
                del cached[block.block_hash]
                if self._events is not None:
                    self._events.append((False, block.block_hash))
                if self.on_evict is not None:
                    assert block.token_bytes is not None
                    self.on_evict(block, block.block_hash, block.token_bytes)
                block.block_hash = None
                block.token_bytes = None
            block.ref_count = 1
            out.append(block)
        self.num_free_blocks -= num_blocks
        return out

    def touch(self, block: Block) -> None:
        """Add a reference to a block found in the prefix cache (out of the free queue if there)."""
        if block.ref_count == 0:
            before, after = block.prev_free, block.next_free
            assert before is not None and after is not None
            before.next_free = after
            after.prev_free = before
            block.prev_free = block.next_free = None
            self.num_free_blocks -= 1
        block.ref_count += 1

    def free(self, block: Block) -> None:
        """Drop one reference; at 0 the block joins the tail of the free queue (its hash stays)."""
        assert block.ref_count > 0, f"double free of {block}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._append_free(block)
            self.num_free_blocks += 1

    def uncache(self, block: Block) -> None:
        """Take a block out of the prefix cache (its hash is forgotten; references stay)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self._events is not None:
                self._events.append((False, block.block_hash))
            block.block_hash = None
            block.token_bytes = None

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int,
                     extra: bytes) -> tuple[list[Block], list[BlockHash]]:
        """The cached blocks holding the first full blocks of token_ids (at most max_blocks), and
        their chain hashes; `extra` is the first block's extra key. Takes no reference."""
        pack = self._pack
        get = self.cached.get
        bs = self.block_size
        blocks: list[Block] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for start in range(0, max_blocks * bs, bs):
            token_bytes = pack(*token_ids[start:start + bs])
            block_hash = hash_block(parent, token_bytes, extra)
            block = get(block_hash)
            if block is None or block.token_bytes != token_bytes:
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
            extra = b""
        return blocks, hashes

    def cache_full_blocks(self, blocks: Sequence[Block | None], block_hashes: list[BlockHash],
                          token_ids: Sequence[int], num_full: int, extra: bytes) -> None:
        """Hash blocks len(block_hashes) .. num_full - 1 of a sequence (appending to its
        block_hashes) and register them; `extra` is the first block's extra key."""
        pack = self._pack
        bs = self.block_size
        cached = self.cached
        for i in range(len(block_hashes), num_full):
            block = blocks[i]
            assert block is not None and block.ref_count > 0 and block.block_hash is None
            token_bytes = pack(*token_ids[i * bs:(i + 1) * bs])
            block_hash = (hash_block(block_hashes[-1], token_bytes) if i
                          else hash_block(None, token_bytes, extra))
            block_hashes.append(block_hash)
            if block_hash not in cached:  # else an equal block is already canonical
                block.block_hash = block_hash
                block.token_bytes = token_bytes
                cached[block_hash] = block
                if self._events is not None:
                    self._events.append((True, block_hash))
                if self.on_cache is not None:
                    self.on_cache(block)

    def register(self, block: Block, block_hash: BlockHash, token_bytes: bytes) -> bool:
        """Enter a referenced block whose K/V was restored from a tier into the prefix cache;
        False (nothing changed) when an equal block is already cached."""
        assert block.ref_count > 0 and block.block_hash is None
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        block.token_bytes = token_bytes
        self.cached[block_hash] = block
        if self._events is not None:
            self._events.append((True, block_hash))
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their data and their references."""
        for block in self.cached.values():
            if self._events is not None and block.block_hash is not None:
                self._events.append((False, block.block_hash))
            block.block_hash = None
            block.token_bytes = None
        self.cached.clear()

    def free_queue(self) -> list[int]:
        """Block ids in the free queue, head (next to be allocated) first. O(n); for tests/debug."""
        out = []
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            out.append(block.block_id)
            block = block.next_free
        return out

    def free_queue_tail(self) -> Block | None:
        """The most recently freed block (walk `prev_free` towards the head); None when empty."""
        block = self._tail.prev_free
        return None if block is self._head else block

    def _append_free(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block

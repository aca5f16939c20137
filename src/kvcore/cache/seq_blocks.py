"""A sequence's record in KVCacheManager: its block table, hashes and the counters the prefix
cache and an int4 cache's window read."""

from __future__ import annotations

from kvcore.cache.block_pool import Block, BlockHash


class SeqBlocks:
    """One sequence's block table and counters, as KVCacheManager keeps them."""

    __slots__ = ("blocks", "block_ids", "num_tokens", "block_hashes", "salt", "num_released",
                 "num_scheduled", "num_written", "num_clean", "fp16_start")

    def __init__(self, salt: bytes) -> None:
        self.blocks: list[Block | None] = []  # the block table; None = released (sliding window)
        self.block_ids: list[int | None] = []  # the same table as ids, kept in step with blocks
        self.num_tokens = 0  # tokens with an allocated slot
        self.block_hashes: list[BlockHash] = []  # chain hashes of the full blocks, in order
        self.salt = salt  # extra key of the first block's hash (tenant isolation)
        self.num_released = 0  # leading blocks already released by the sliding window
        # int4 window: tokens the steps scheduled so far write (drafts excluded), those of the
        # steps already launched, the leading blocks the in-step seal pass has been through,
        # and the first block this sequence may still read in fp16 (int4_window's rule)
        self.num_scheduled = 0
        self.num_written = 0
        self.num_clean = 0
        self.fp16_start = 0

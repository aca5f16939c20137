"""The paged KV cache bookkeeping: block pool, block tables, prefix cache, copy-on-write."""

from kvcore.cache.block_pool import Block, BlockPool
from kvcore.cache.manager import Admission, CopyOp, KVCacheManager

__all__ = ["Admission", "Block", "BlockPool", "CopyOp", "KVCacheManager"]

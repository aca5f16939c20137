"""The paged KV cache bookkeeping: block pool, block tables, prefix cache, copy-on-write."""

from kvcore.cache.block_pool import Block, BlockHash, BlockPool, CacheEvent, chain_hashes, salt_key
from kvcore.cache.manager import PENDING_TOKEN_ID, Admission, CopyOp, KVCacheManager

__all__ = ["PENDING_TOKEN_ID", "Admission", "Block", "BlockHash", "BlockPool", "CacheEvent",
           "CopyOp", "KVCacheManager", "chain_hashes", "salt_key"]

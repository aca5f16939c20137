"""KV tiers behind the pool: pages (one block of every layer's K and V, one record) kept in host
memory and on disk under the block's salted chain hash, written in the background, loaded back
when that beats recomputing (kvcore.engine.tier_driver drives them from the engine step)."""

from kvcore.cache.tiers.codec import PageCodec, make_codec
from kvcore.cache.tiers.disk import DiskTier
from kvcore.cache.tiers.host import HostTier
from kvcore.cache.tiers.layout import Gathered, PageCopier, PageLayout, TierStreams, layout_of
from kvcore.cache.tiers.stats import TierStats
from kvcore.cache.tiers.store import LoadJob, PageKey, TierStore

__all__ = ["DiskTier", "Gathered", "HostTier", "LoadJob", "PageCodec", "PageCopier", "PageKey",
           "PageLayout", "TierStats", "TierStore", "TierStreams", "layout_of", "make_codec"]

"""The host-memory tier: pages in process memory under a byte budget, least recently used out
first, keyed by the block's salted chain hash and confirmed by its token ids."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from kvcore.cache.block_pool import BlockHash
from kvcore.cache.tiers.codec import PageCodec


class HostTier:
    """Thread-safe: the engine step looks pages up, the tier's writer puts them, its loader
    reads them."""

    name = "host"
    enabled = True  # (the disk tier can turn itself off)

    def __init__(self, capacity_bytes: int, codec: PageCodec) -> None:
        if capacity_bytes < codec.payload_bytes():
            raise ValueError(f"kv_offload_size ({capacity_bytes} bytes) holds no page of "
                             f"{codec.payload_bytes()} bytes")
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.page_bytes = codec.payload_bytes()
        # chain hash -> (token ids of the block as packed int64, payload), oldest use first
        self._pages: OrderedDict[BlockHash, tuple[bytes, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_evicted = 0  # pages dropped for room

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._pages  # a dict read: atomic under the GIL

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def put(self, keys: list[tuple[BlockHash, bytes]], pages: np.ndarray) -> int:
        """Store pages (n, page_bytes) uint8 under their (hash, token bytes); a hash already
        held is refreshed, not stored twice. Returns how many were new."""
        new = [i for i, (block_hash, _) in enumerate(keys) if block_hash not in self._pages]
        payloads = self.codec.encode(pages[new]) if new else []
        num_new = 0
        with self._lock:
            for i, payload in zip(new, payloads, strict=True):
                block_hash, token_bytes = keys[i]
                if block_hash in self._pages:
                    continue
                self._pages[block_hash] = (token_bytes, payload)
                self.num_bytes += payload.nbytes
                num_new += 1
            for block_hash, _ in keys:
                if block_hash in self._pages:
                    self._pages.move_to_end(block_hash)
            while self.num_bytes > self.capacity_bytes:
                _, (_, payload) = self._pages.popitem(last=False)
                self.num_bytes -= payload.nbytes
                self.num_evicted += 1
        return num_new

    def get(self, block_hash: BlockHash, token_bytes: bytes, out: np.ndarray) -> bool:
        """Decode the page into out (page_bytes,) uint8; False when it is not held (or holds
        other tokens: never served)."""
        with self._lock:
            entry = self._pages.get(block_hash)
            if entry is None or entry[0] != token_bytes:
                return False
            self._pages.move_to_end(block_hash)
        self.codec.decode(entry[1], out)
        return True

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self.num_bytes = 0

"""A page: one block of every layer's K and V as one contiguous byte record, and the copy path
between the pool's per-layer arrays and a batch of pages (two array operations per layer per
batch, however many blocks: a tier move of n blocks is 2 x layers copies, not 2 x layers x n).

Page bytes, in order: layer 0 K, layer 0 V, layer 1 K, ... (MLA's shared K/V: one array per
layer); each array's block as its raw storage bytes (fp8 / bf16 bits, int4's sealed rows), so a
page written back is bit for bit the block the pool had.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvcore.cache.kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class PageLayout:
    """Where each array's block sits in a page."""

    dtype: str  # the pool's cache dtype (fp32 fp16 bf16 fp8 int4)
    num_layers: int
    shared_kv: bool  # MLA: one array per layer is both K and V
    widths: tuple[int, ...]  # bytes of one block of each array, in page order
    # (block_size, kv_heads, head_dim) of a float pool's block; None for int4's rows
    block_shape: tuple[int, int, int] | None

    @property
    def page_bytes(self) -> int:
        return sum(self.widths)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for width in self.widths:
            out.append(at)
            at += width
        return tuple(out)


def page_arrays(kv_cache: KVCache) -> list[Any]:
    """The pool's arrays in page order (an int4 cache's sealed rows; never its fp16 window)."""
    if kv_cache.shared_kv:
        return list(kv_cache.key_caches)
    return [a for pair in zip(kv_cache.key_caches, kv_cache.value_caches, strict=True)
            for a in pair]


def layout_of(kv_cache: KVCache) -> PageLayout:
    arrays = page_arrays(kv_cache)
    widths = tuple(int(a.nbytes) // kv_cache.num_blocks for a in arrays)
    shape = None if kv_cache.dtype == "int4" else (
        kv_cache.block_size, kv_cache.num_kv_heads, kv_cache.head_dim)
    return PageLayout(kv_cache.dtype, kv_cache.num_layers, kv_cache.shared_kv, widths, shape)


class Event(Protocol):
    def synchronize(self) -> None: ...


class TierStreams(Protocol):
    """A device's side of the copy path (CuPy in cuda_copy.py; a NumPy stand-in in the
    tests): the tier's own stream, pinned host buffers and the ordering between streams."""

    xp: Any  # the array module of the pool's arrays

    def pinned(self, nbytes: int) -> np.ndarray: ...  # (nbytes,) uint8, page-locked

    def tier(self) -> AbstractContextManager[Any]: ...  # the tier stream is current inside

    def tier_waits_compute(self) -> None: ...  # tier work after all compute queued so far

    def compute_waits_tier(self) -> Event: ...  # compute after all tier work queued so far

    def download(self, src: Any, dst: np.ndarray) -> Event: ...  # async, on the tier stream

    def upload(self, src: np.ndarray, dst: Any) -> None: ...  # async, on the tier stream


@dataclass(slots=True)
class Gathered:
    """Pages copied out of the pool: `pages` (n, page_bytes) uint8 on the host, readable once
    `ready` (None: already) has completed."""

    pages: np.ndarray
    ready: Event | None = None

    def wait(self) -> np.ndarray:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self.pages


class PageCopier:
    """Gathers pool blocks into page records and scatters records back into blocks.

    On the CPU (streams None) both run in place, synchronously (the step's device work).
    With `streams`, both run on the tier's own stream, ordered after the compute queued so
    far, and the compute queued after them waits for them (the forward that overwrites an
    evicted block, the one that reads a loaded block); the host copy of a gather is readable
    once its event completes, and a scatter's pinned buffer is kept until its copy ran.
    """

    def __init__(self, kv_cache: KVCache, streams: TierStreams | None = None) -> None:
        self.layout = layout_of(kv_cache)
        self.num_blocks = kv_cache.num_blocks
        # (num_blocks, width) byte views of the arrays: no copy
        self.arrays = [a.view(np.uint8).reshape(self.num_blocks, -1)
                       for a in page_arrays(kv_cache)]
        self.streams = streams
        self._in_flight: list[tuple[Event, np.ndarray]] = []  # scatters' pinned buffers

    def host_buffer(self, num_pages: int) -> np.ndarray:
        """(num_pages, page_bytes) uint8 host memory a load fills (pinned with a device)."""
        nbytes = num_pages * self.layout.page_bytes
        flat = np.empty(nbytes, np.uint8) if self.streams is None else self.streams.pinned(
            nbytes)
        return flat.reshape(num_pages, self.layout.page_bytes)

    def _ids(self, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, np.int64)  # (n,)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"block ids {list(block_ids)} outside [0, {self.num_blocks})")
        return ids

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        ids = self._ids(block_ids)
        streams = self.streams
        if streams is None:
            pages = np.empty((len(ids), self.layout.page_bytes), np.uint8)
            for array, at, width in zip(self.arrays, self.layout.offsets, self.layout.widths,
                                        strict=True):
                pages[:, at:at + width] = array[ids]
            return Gathered(pages)
        xp = streams.xp
        host = self.host_buffer(len(ids))
        streams.tier_waits_compute()  # the blocks as the steps queued so far left them
        with streams.tier():
            dev_ids = xp.asarray(ids)
            staging = xp.empty(host.shape, np.uint8)  # (n, page_bytes) on the device
            for array, at, width in zip(self.arrays, self.layout.offsets, self.layout.widths,
                                        strict=True):
                staging[:, at:at + width] = array[dev_ids]
        streams.compute_waits_tier()  # nothing overwrites the blocks before they are copied
        with streams.tier():
            ready = streams.download(staging, host)
        return Gathered(host, ready)

    def scatter(self, block_ids: Sequence[int], pages: np.ndarray) -> None:
        """pages (n, page_bytes) uint8 (host) -> the blocks, in every array."""
        ids = self._ids(block_ids)
        if pages.shape != (len(ids), self.layout.page_bytes) or pages.dtype != np.uint8:
            raise ValueError(f"pages must be ({len(ids)}, {self.layout.page_bytes}) uint8, got "
                             f"{pages.dtype} {pages.shape}")
        streams = self.streams
        if streams is None:
            for array, at, width in zip(self.arrays, self.layout.offsets, self.layout.widths,
                                        strict=True):
                array[ids] = pages[:, at:at + width]
            return
        xp = streams.xp
        self._in_flight = [(e, b) for e, b in self._in_flight if not _done(e)]
        streams.tier_waits_compute()  # after every step that may still write these blocks
        with streams.tier():
            dev_ids = xp.asarray(ids)
            staging = xp.empty(pages.shape, np.uint8)
            streams.upload(pages, staging)
            for array, at, width in zip(self.arrays, self.layout.offsets, self.layout.widths,
                                        strict=True):
                array[dev_ids] = staging[:, at:at + width]
        self._in_flight.append((streams.compute_waits_tier(), pages))


def _done(event: Event) -> bool:
    query = getattr(event, "done", None)
    return bool(query) if query is not None else False

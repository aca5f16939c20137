"""KV pages: one record per block (every layer's K and V), copied between the pool and a batch of
pages bit for bit for every KV dtype; the host tier's codecs; the GPU copy path's ordering, with
NumPy standing in for the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvcore.cache.kv_cache import CACHE_DTYPES, KVCache
from kvcore.cache.tiers import HostTier, PageCopier, layout_of, make_codec
from kvcore.planner import page_bytes

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 12, 4, 2, 16


def random_cache(dtype: str, seed: int = 0, shared_kv: bool = False) -> KVCache:
    """A pool whose every byte is random (int4: its sealed rows; fp8 / bf16: raw bits)."""
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype, shared_kv=shared_kv,
                    num_window_slots=4 if dtype == "int4" else None)
    rng = np.random.default_rng(seed)
    arrays = cache.key_caches if shared_kv else [*cache.key_caches, *cache.value_caches]
    for array in arrays:
        raw = array.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)
        if dtype in ("fp16", "fp32", "bf16"):  # finite values: a NaN's bits compare unequal
            array[...] = np.nan_to_num(array.astype(np.float32), nan=0.5, posinf=1.0,
                                       neginf=-1.0).astype(array.dtype)
    return cache


def block_bytes(cache: KVCache, block_id: int) -> bytes:
    arrays = cache.key_caches if cache.shared_kv else [
        a for pair in zip(cache.key_caches, cache.value_caches, strict=True) for a in pair]
    return b"".join(a[block_id].tobytes() for a in arrays)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_gather_then_scatter_is_bit_exact_for_every_kv_dtype(dtype: str) -> None:
    src, dst = random_cache(dtype, 1), random_cache(dtype, 2)
    copier = PageCopier(src)
    ids = [7, 0, 11, 3]
    pages = copier.gather(ids).wait()
    assert pages.shape == (4, copier.layout.page_bytes) and pages.flags.c_contiguous
    # a page is the block's K then V of layer 0, then of layer 1 ...: one contiguous record
    for row, block_id in zip(pages, ids, strict=True):
        assert row.tobytes() == block_bytes(src, block_id)
    PageCopier(dst).scatter([1, 2, 5, 9], pages)
    for block_id, src_id in zip([1, 2, 5, 9], ids, strict=True):
        assert block_bytes(dst, block_id) == block_bytes(src, src_id)
    untouched = random_cache(dtype, 2)
    assert block_bytes(dst, 0) == block_bytes(untouched, 0)  # other blocks as they were


def test_page_bytes_match_the_planner_for_every_dtype_and_shared_kv() -> None:
    for dtype in CACHE_DTYPES:
        layout = layout_of(random_cache(dtype))
        assert layout.page_bytes == page_bytes(LAYERS, HEADS, DIM, dtype, BS)
        assert len(layout.widths) == 2 * LAYERS
    shared = layout_of(random_cache("fp16", shared_kv=True))
    assert len(shared.widths) == LAYERS
    assert shared.page_bytes == page_bytes(LAYERS, HEADS, DIM, "fp16", BS, shared_kv=True)
    for name in ("int4", "fp8"):
        codec = make_codec(name, layout_of(random_cache("fp16")))
        assert codec.payload_bytes() == page_bytes(LAYERS, HEADS, DIM, "fp16", BS,
                                                   offload_dtype=name)


def test_copier_refuses_bad_block_ids_and_page_shapes() -> None:
    copier = PageCopier(random_cache("fp16"))
    with pytest.raises(ValueError, match="outside"):
        copier.gather([BLOCKS])
    with pytest.raises(ValueError, match="pages must be"):
        copier.scatter([0], np.zeros((1, 3), np.uint8))


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_host_tier_round_trip_is_bit_exact_for_every_kv_dtype(dtype: str) -> None:
    cache = random_cache(dtype, 3)
    copier = PageCopier(cache)
    tier = HostTier(10 * copier.layout.page_bytes, make_codec("auto", copier.layout))
    pages = copier.gather([4, 5]).wait()
    keys = [(bytes([1]) * 32, b"a" * 8 * BS), (bytes([2]) * 32, b"b" * 8 * BS)]
    assert tier.put(keys, pages) == 2 and tier.put(keys, pages) == 0  # held once
    out = np.zeros(copier.layout.page_bytes, np.uint8)
    assert tier.get(keys[1][0], keys[1][1], out)
    assert out.tobytes() == block_bytes(cache, 5)
    assert not tier.get(keys[1][0], b"c" * 8 * BS, out)  # other token ids: never served


def test_host_tier_evicts_least_recently_used_pages_under_its_budget() -> None:
    copier = PageCopier(random_cache("fp16"))
    tier = HostTier(3 * copier.layout.page_bytes, make_codec("auto", copier.layout))
    out = np.zeros(copier.layout.page_bytes, np.uint8)
    keys = [(bytes([i]) * 32, bytes([i]) * 8 * BS) for i in range(4)]
    for i in range(3):
        tier.put([keys[i]], copier.gather([i]).wait())
    assert tier.get(*keys[0], out)  # page 0 used: page 1 is the oldest now
    tier.put([keys[3]], copier.gather([3]).wait())
    assert [k[0] in tier for k in keys] == [True, False, True, True]
    assert tier.num_bytes == 3 * copier.layout.page_bytes and tier.num_evicted == 1


@pytest.mark.parametrize(("name", "tolerance"), [("int4", 0.08), ("fp8", 0.04)])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_lossy_host_codecs_restore_close_values_in_fewer_bytes(name: str, tolerance: float,
                                                               dtype: str) -> None:
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype)
    rng = np.random.default_rng(5)
    for array in [*cache.key_caches, *cache.value_caches]:
        array[...] = rng.normal(0, 1, array.shape).astype(array.dtype)
    copier = PageCopier(cache)
    codec = make_codec(name, copier.layout)
    assert not codec.lossless and codec.payload_bytes() < copier.layout.page_bytes
    pages = copier.gather([0, 1, 2]).wait()
    payloads = codec.encode(pages)
    assert [p.nbytes for p in payloads] == [codec.payload_bytes()] * 3
    out = np.zeros(copier.layout.page_bytes, np.uint8)
    for i, block_id in enumerate([0, 1, 2]):
        codec.decode(payloads[i], out)
        restored = PageCopier(KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype))
        restored.scatter([block_id], out[None])
        for layer in range(LAYERS):
            for got, want in ((restored.arrays[2 * layer], cache.key_caches[layer]),
                              (restored.arrays[2 * layer + 1], cache.value_caches[layer])):
                values = got.view(want.dtype).reshape(want.shape)[block_id].astype(np.float32)
                exact = want[block_id].astype(np.float32)
                scale = np.abs(exact).max()
                assert np.abs(values - exact).max() <= tolerance * scale


def test_lossy_codecs_refuse_pools_they_cannot_compress() -> None:
    for dtype in ("fp8", "int4"):
        with pytest.raises(ValueError, match="compresses an fp32, fp16 or bf16 pool"):
            make_codec("int4", layout_of(random_cache(dtype)))
    with pytest.raises(ValueError, match="kv_offload_dtype"):
        make_codec("q2", layout_of(random_cache("fp16")))


class FakeEvent:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def synchronize(self) -> None:
        self.log.append(f"sync {self.name}")
        self.done = True


class NumpyStreams:
    """TierStreams with NumPy arrays standing in for device arrays; records the order of the
    stream operations the copier asks for."""

    xp = np

    def __init__(self) -> None:
        self.log: list[str] = []
        self.in_tier = False

    def pinned(self, nbytes: int) -> np.ndarray:
        self.log.append("pinned")
        return np.zeros(nbytes, np.uint8)

    @contextlib.contextmanager
    def tier(self) -> Iterator[None]:
        self.in_tier = True
        try:
            yield
        finally:
            self.in_tier = False

    def tier_waits_compute(self) -> None:
        assert not self.in_tier
        self.log.append("tier waits compute")

    def compute_waits_tier(self) -> Any:
        assert not self.in_tier  # called with the compute stream current
        self.log.append("compute waits tier")
        return FakeEvent(self.log, "tier")

    def download(self, src: Any, dst: np.ndarray) -> Any:
        assert self.in_tier
        self.log.append("download")
        dst[...] = src
        return FakeEvent(self.log, "download")

    def upload(self, src: np.ndarray, dst: Any) -> None:
        assert self.in_tier
        self.log.append("upload")
        dst[...] = src


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "int4"])
def test_device_copy_path_orders_the_tier_stream_around_compute(dtype: str) -> None:
    src, dst = random_cache(dtype, 6), random_cache(dtype, 7)
    streams = NumpyStreams()
    gathered = PageCopier(src, streams).gather([3, 8])
    assert streams.log == ["pinned", "tier waits compute", "compute waits tier", "download"]
    pages = gathered.wait()  # the writer thread waits for the download's event
    assert streams.log[-1] == "sync download"
    assert [row.tobytes() for row in pages] == [block_bytes(src, 3), block_bytes(src, 8)]
    streams.log.clear()
    copier = PageCopier(dst, streams)
    buffer = copier.host_buffer(2)  # a load reads into pinned memory
    buffer[...] = pages
    copier.scatter([0, 1], buffer)
    assert streams.log == ["pinned", "tier waits compute", "upload", "compute waits tier"]
    assert block_bytes(dst, 0) == block_bytes(src, 3) and block_bytes(dst, 1) == block_bytes(
        src, 8)

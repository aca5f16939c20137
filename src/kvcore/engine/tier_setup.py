"""The KV tiers an EngineConfig asks for, built over the engine's pool: the copy path for its
device, the host tier, the disk tier (under this model's fingerprint) and their driver."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from kvcore.cache import KVCacheManager
from kvcore.cache.kv_cache import KVCache
from kvcore.cache.tiers import DiskTier, HostTier, PageCopier, TierStore, make_codec
from kvcore.config import EngineConfig
from kvcore.engine.tier_driver import TierDriver
from kvcore.request import Sequence

log = structlog.get_logger("kvcore.engine")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".json")  # what decides the K/V a model computes
_CHUNK = 8 * 2**20


def make_tier_driver(config: EngineConfig, kv: KVCacheManager, kv_cache: KVCache, device: str,
                     seqs: Mapping[str, Sequence]) -> TierDriver | None:
    """The driver of config.tiers over this pool (None: no tier). The tiers need the prefix
    cache: turning it off is a ValueError; a model whose sliding window turns it off runs
    without tiers (one warning)."""
    tc = config.tiers
    if not tc.enabled:
        return None
    if not config.cache.enable_prefix_caching:
        raise ValueError("KV tiers (kv_offload_size, kv_tier_dir) need the prefix cache "
                         "(enable_prefix_caching)")
    if not kv.enable_prefix_caching:
        log.warning("kv tiers off: the model's sliding window turns the prefix cache off")
        return None
    streams = None
    if device == "cuda":
        from kvcore.cache.tiers.cuda_copy import CupyTierStreams

        streams = CupyTierStreams()
    copier = PageCopier(kv_cache, streams)
    layout = copier.layout
    tiers: list[HostTier | DiskTier] = []
    if tc.kv_offload_size:
        codec = make_codec(tc.kv_offload_dtype, layout)
        if device == "cpu" and codec.lossless:
            log.info("kv host tier on the cpu holds the pool's own bytes: a larger pool "
                     "(kv_cache_memory) holds as much without copies; kv_offload_dtype int4 "
                     "holds about 3x more tokens, not bit exact")
        tiers.append(HostTier(tc.kv_offload_size, codec))
    if tc.kv_tier_dir is not None:
        fingerprint = model_fingerprint(config, kv_cache, device, Path(tc.kv_tier_dir))
        tiers.append(DiskTier(tc.kv_tier_dir, tc.kv_tier_disk_size, fingerprint,
                              layout.page_bytes, kv.block_size))
    store = TierStore(tiers, layout.page_bytes, copier.host_buffer)
    log.info("kv tiers", tiers={t.name: t.capacity_bytes for t in tiers},
             page_bytes=layout.page_bytes, write_policy=tc.kv_tier_write_policy, swap=tc.swap,
             offload_dtype=tc.kv_offload_dtype)
    return TierDriver(kv, store, copier, seqs, tc.kv_tier_write_policy, tc.swap)


def model_fingerprint(config: EngineConfig, kv_cache: KVCache, device: str,
                      cache_dir: Path) -> bytes:
    """What makes a page this model's: the weights' digest, how they run (device, weight
    format), and the page's shape (layers, heads, head_dim, KV dtype and fp8 scales, block
    size, int4 group)."""
    facts = {"weights": weights_digest(Path(config.model), cache_dir).hex(), "device": device,
             "quantization": config.quantization, "layers": kv_cache.num_layers,
             "kv_heads": kv_cache.num_kv_heads, "head_dim": kv_cache.head_dim,
             "shared_kv": kv_cache.shared_kv, "dtype": kv_cache.dtype,
             "block_size": kv_cache.block_size, "k_scales": kv_cache.k_scales,
             "v_scales": kv_cache.v_scales,
             "int4_group": getattr(kv_cache, "int4_group", None)}
    return hashlib.sha256(b"kvcore kv page v1\0" + json.dumps(facts, sort_keys=True).encode()
                          ).digest()


def weights_digest(model_dir: Path, cache_dir: Path) -> bytes:
    """BLAKE2b of the model directory's weight and config files (names, sizes, contents).
    Remembered in cache_dir under the files' names, sizes and modification times, so a
    restart does not read the weights again."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    stamp = hashlib.blake2b(digest_size=16)
    for path in files:
        stat = path.stat()
        stamp.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    memo = cache_dir / f".weights-{stamp.hexdigest()}"
    try:
        cached = memo.read_bytes()
        if len(cached) == 32:
            return cached
    except OSError:
        pass
    digest = hashlib.blake2b(digest_size=32)
    for path in files:
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    result = digest.digest()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        temp = cache_dir / f"{memo.name}.{os.getpid()}.tmp"
        temp.write_bytes(result)
        temp.replace(memo)
    except OSError:
        pass  # an unwritable directory: the disk tier turns itself off and says why
    return result

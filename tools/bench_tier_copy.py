"""The KV tiers' copy path on the default model's shape (30 layers x 3 KV heads x 64, fp16,
16-token blocks: 360 KiB a page): pages gathered from the pool in one batch (two array
operations per layer) against one copy per block and layer (fragments), pages scattered back,
and a disk tier's writes and reads (page cache), each as GB/s and as milliseconds per 1,000
tokens, beside what recomputing 1,000 tokens costs (--prefill-tps, measured separately).

    python tools/bench_tier_copy.py --blocks 16 64 256 --json out.json

Validates before it times: gathered pages equal the pool's blocks, scattered blocks equal the
pages, pages read from disk equal the pages written.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcore.cache import chain_hashes
from kvcore.cache.kv_cache import KVCache
from kvcore.cache.tiers import DiskTier, PageCopier


def best(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def fragments(cache: KVCache, ids: np.ndarray, out: np.ndarray) -> None:
    """The per-layer way: one copy per block, layer and K/V."""
    at = 0
    for k, v in zip(cache.key_caches, cache.value_caches, strict=True):
        for array in (k, v):
            width = array[0].nbytes
            for row, block_id in enumerate(ids):
                out[row, at:at + width] = array[block_id].view(np.uint8).reshape(-1)
            at += width


def measure(cache: KVCache, copier: PageCopier, n: int, args: argparse.Namespace,
            rng: np.random.Generator) -> dict[str, Any]:
    page = copier.layout.page_bytes
    ids = rng.choice(args.pool_blocks, n, replace=False)
    pages = copier.gather(ids).wait()
    naive = np.empty_like(pages)
    fragments(cache, ids, naive)
    assert np.array_equal(pages, naive), "gather differs from the per-block copies"
    dst = rng.choice(args.pool_blocks, n, replace=False)
    copier.scatter(dst, pages)
    assert np.array_equal(copier.gather(dst).wait(), pages), "scatter lost bytes"
    t_gather = best(lambda: copier.gather(ids).wait(), args.repeats)
    t_frag = best(lambda: fragments(cache, ids, naive), args.repeats)
    t_scatter = best(lambda: copier.scatter(dst, pages), args.repeats)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        disk = DiskTier(root, 1 << 40, b"b" * 32, page, args.block_size)
        keys = [(chain_hashes([i] * args.block_size, args.block_size, f"s{n}")[0],
                 np.full(args.block_size, i, "<i8").tobytes()) for i in range(n)]
        start = time.perf_counter()
        disk.put(keys, pages)
        t_write = time.perf_counter() - start
        out = np.empty(page, np.uint8)

        def read() -> None:
            for i, (block_hash, tokens) in enumerate(keys):
                assert disk.get(block_hash, tokens, out)
                assert i or np.array_equal(out, pages[0])
        t_read = best(read, args.repeats)
    nbytes, tokens = n * page, n * args.block_size
    row: dict[str, Any] = {"blocks": n, "bytes": nbytes}
    for name, seconds in (("gather", t_gather), ("fragments", t_frag), ("scatter", t_scatter),
                          ("disk_write", t_write), ("disk_read", t_read)):
        row[f"{name}_gb_s"] = round(nbytes / seconds / 1e9, 2)
        row[f"{name}_ms_per_1k_tokens"] = round(seconds / tokens * 1e6, 2)
    row["fragments_over_gather"] = round(t_frag / t_gather, 1)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    cache = KVCache(args.layers, args.pool_blocks, args.block_size, args.kv_heads,
                    args.head_dim, "fp16")
    rng = np.random.default_rng(0)
    for array in (*cache.key_caches, *cache.value_caches):
        array[...] = rng.standard_normal(array.shape).astype(np.float16)
    copier = PageCopier(cache)
    results: dict[str, Any] = {"page_bytes": copier.layout.page_bytes,
                               "rows": [measure(cache, copier, n, args, rng)
                                        for n in args.blocks]}
    if args.prefill_tps:
        results["recompute_ms_per_1k_tokens"] = round(1e6 / args.prefill_tps, 1)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the disk tier writes (default: $TMPDIR)")
    p.add_argument("--prefill-tps", type=float, default=None,
                   help="measured prefill tokens/s, to print recompute's cost beside")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    results = run(args)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()

"""Routers side by side on one local Ray Serve cluster: prefix vs least-loaded vs round-robin.

The shared-prefix dataset (16 groups x 8 requests, 512-token prefixes, short suffixes, shuffled)
at a fixed concurrency, once per router against the same replicas (the router is the ingress's
policy object, swapped between runs; every run draws fresh prefixes, so no run reuses another's
cache). Reports throughput, mean and p99 TTFT, and the cached-token share.

    flock /tmp/kvcore-bench.lock python tools/bench_cluster.py --replicas 2 --num-blocks 320

With 320 blocks of 16 per replica a pool holds about half the groups' prefixes (16 x 32 blocks)
plus the running batch's own blocks: the regime a deployment is in once its working set outgrows
one replica's cache, where routing decides whether a prefix is found again. With 576 blocks each
pool holds every prefix, and routing only saves each group's second miss. Every request must
succeed, or the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from kvcore.cluster.app import Cluster, ClusterOptions, connect_ray  # noqa: E402
from kvcore.cluster.policy import POLICIES, RoutingPolicy  # noqa: E402
from kvcore.cluster.serve import build_app  # noqa: E402
from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402


async def run_router(url: str, cluster: Cluster, router: str, args: argparse.Namespace,
                     seed: int) -> dict[str, Any]:
    cluster.state.policy = RoutingPolicy(router, load_margin=args.load_margin,
                                         rng=random.Random(seed))
    before = cluster.state.snapshot()
    ns = argparse.Namespace(dataset="shared-prefix", num_prompts=args.num_groups * args.group_size,
                            num_groups=args.num_groups, prefix_len=args.prefix_len,
                            input_len=args.suffix_len, output_len=args.output_len, seed=seed,
                            token_id_min=100, vocab_size=args.vocab_size, model=None,
                            base_url=url)
    prompts = bench_serving.make_prompts(ns)
    semaphore = asyncio.Semaphore(args.concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async def one(prompt: bench_serving.Prompt) -> bench_serving.Result:
            async with semaphore:
                return await bench_serving.one_request(http, ns, prompt, None)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{router}: {len(failed)} requests failed, e.g. {failed[0]}")
    after = cluster.state.snapshot()
    predicted = sum(a.predicted_tokens - (before[r].predicted_tokens if r in before else 0)
                    for r, a in after.items())
    ttfts = [r.ttft * 1000 for r in results if r.ttft is not None]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {"router": router, "requests": len(results), "elapsed_s": elapsed,
            "req_per_s": len(results) / elapsed,
            "output_tok_per_s": sum(r.output_tokens for r in results) / elapsed,
            "mean_ttft_ms": statistics.fmean(ttfts), "p99_ttft_ms": bench_serving.pct(ttfts, 99),
            "cached_share": cached / prompt_tokens, "cached_tokens": cached,
            "predicted_cached_tokens": predicted,
            "per_replica": {r: a.routed - (before[r].routed if r in before else 0)
                            for r, a in sorted(after.items())}}


async def bench(args: argparse.Namespace, model_dir: str) -> list[dict[str, Any]]:
    from aiohttp import web

    options = ClusterOptions(num_replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
                             local_num_cpus=args.num_cpus)
    started = connect_ray(options)
    config = EngineConfig(model=model_dir, device="cpu",
                          cache=CacheConfig(block_size=16, num_blocks=args.num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=args.batch_tokens))
    clusters: list[Cluster] = []
    app = build_app(config, options, clusters, started, served_model_name="bench")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            while True:  # Ray starts; the replicas load the model
                async with http.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(1)
        reports = []
        for i, router in enumerate(args.routers):
            report = await run_router(url, clusters[0], router, args, args.seed + 1000 * i)
            print(json.dumps(report), flush=True)
            reports.append(report)
        return reports
    finally:
        await runner.cleanup()
        for cluster in clusters:
            cluster.shutdown()


def print_table(reports: list[dict[str, Any]]) -> None:
    base = next((r for r in reports if r["router"] == "round-robin"), reports[0])
    print("| router | req/s | output tok/s | mean TTFT ms | p99 TTFT ms | cached share | "
          "vs round-robin (share, req/s) |")
    print("|---|---|---|---|---|---|---|")
    for r in reports:
        share = r["cached_share"] / base["cached_share"] if base["cached_share"] else float("inf")
        print(f"| {r['router']} | {r['req_per_s']:.2f} | {r['output_tok_per_s']:.1f} | "
              f"{r['mean_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['cached_share']:.3f} | "
              f"{share:.2f}x, {r['req_per_s'] / base['req_per_s']:.2f}x |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model directory (default: the default model)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--routers", nargs="+", default=["round-robin", "least-loaded", "prefix"],
                   choices=POLICIES)
    p.add_argument("--num-groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=320, help="KV blocks per replica")
    p.add_argument("--batch-tokens", type=int, default=1024, help="token budget of one step")
    p.add_argument("--load-margin", type=int, default=4)
    p.add_argument("--cpus-per-replica", type=float, default=1.0)
    p.add_argument("--num-cpus", type=int, default=None, help="the local Ray's CPUs")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the reports here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    from kvcore.model.hub import resolve_model

    args = parse_args(argv)
    reports = asyncio.run(bench(args, str(resolve_model(args.model))))
    print_table(reports)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2))
    return reports


if __name__ == "__main__":
    main()

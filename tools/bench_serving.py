"""Serving benchmark with vLLM `bench serve` semantics, against a running kvcore (or vLLM) server.

TTFT = first non-empty chunk - send; ITL = gaps between later chunks; E2EL = last chunk - send;
TPOT = (E2EL - TTFT) / (output tokens - 1); request / output / total token throughput.

    python tools/bench_serving.py --base-url http://127.0.0.1:8000 --dataset random \
        --num-prompts 256 --max-concurrency 256 --input-len 32 --output-len 32

Datasets (prompts are token ids, so lengths are exact): random (fixed input/output lengths),
shared-prefix (groups of prompts sharing a --prefix-len system prefix), mixed (lengths drawn
uniformly from [len/4, 2 len]). --disconnect-fraction closes that share of streams mid-way.
After the run it reads /metrics until no request runs and reports the blocks still held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    output_len: int


@dataclass(slots=True)
class Result:
    ok: bool = False
    disconnected: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2el: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


def make_prompts(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    lo, hi = args.token_id_min, args.vocab_size  # skip the special tokens at the low ids

    def tokens(n: int) -> list[int]:
        return [rng.randrange(lo, hi) for _ in range(n)]

    prompts = []
    if args.dataset == "random":
        prompts = [Prompt(tokens(args.input_len), args.output_len) for _ in range(args.num_prompts)]
    elif args.dataset == "shared-prefix":
        prefixes = [tokens(args.prefix_len) for _ in range(args.num_groups)]
        prompts = [Prompt(prefixes[i % args.num_groups] + tokens(args.input_len), args.output_len)
                   for i in range(args.num_prompts)]
        rng.shuffle(prompts)
    else:  # mixed
        for _ in range(args.num_prompts):
            n_in = rng.randint(max(1, args.input_len // 4), args.input_len * 2)
            n_out = rng.randint(max(1, args.output_len // 4), args.output_len * 2)
            prompts.append(Prompt(tokens(n_in), n_out))
    return prompts


async def one_request(http: aiohttp.ClientSession, args: argparse.Namespace, prompt: Prompt,
                      disconnect_after: int | None) -> Result:
    body = {"model": args.model, "prompt": prompt.token_ids, "max_tokens": prompt.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    result = Result()
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with http.post(f"{args.base_url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    result.error = str(data["error"])[:200]
                    return result
                if data.get("usage"):
                    usage = data["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0)
                if not data["choices"] or not data["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    result.disconnected = True
                    resp.close()  # the client goes away mid-stream
                    return result
        result.e2el = last - start
        result.ok = result.ttft is not None
        if not result.ok:
            result.error = "no content"
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def read_metrics(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    async with http.get(f"{base_url}/metrics") as resp:
        text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvcore:") and " " in line:
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            if name == "kvcore:cache_config_info":
                values["num_blocks"] = float(key.split('num_blocks="', 1)[1].split('"')[0])
            values[name] = float(value)
    return values


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100  # linear interpolation, as numpy.percentile
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(name: str, values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {f"mean_{name}_ms": statistics.fmean(ms) if ms else float("nan"),
            f"median_{name}_ms": pct(ms, 50), f"p90_{name}_ms": pct(ms, 90),
            f"p99_{name}_ms": pct(ms, 99)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = make_prompts(args)
    rng = random.Random(args.seed + 1)
    num_disconnect = round(args.disconnect_fraction * len(prompts))
    leavers = set(rng.sample(range(len(prompts)), num_disconnect))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as http:
        before = await read_metrics(http, args.base_url)
        limit = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def guarded(i: int) -> Result:
            async with limit:
                cut = rng.randint(1, max(1, prompts[i].output_len // 2)) if i in leavers else None
                return await one_request(http, args, prompts[i], cut)

        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(guarded(i)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        # the server frees an aborted request's blocks within a step: wait for it to settle
        after = await read_metrics(http, args.base_url)
        deadline = time.perf_counter() + 60
        while (after.get("kvcore:num_requests_running", 0) or after.get(
                "kvcore:num_requests_waiting", 0)) and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
            after = await read_metrics(http, args.base_url)
    done = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok and not r.disconnected]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in done
             if r.e2el is not None and r.ttft is not None and r.output_tokens > 1]
    report: dict[str, Any] = {
        "dataset": args.dataset, "num_prompts": len(prompts),
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        "completed": len(done), "disconnected": sum(r.disconnected for r in results),
        "errors": len(errors), "first_errors": [r.error for r in errors[:3]],
        "duration_s": duration, "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens, "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
        **summarize("ttft", [r.ttft for r in done if r.ttft is not None]),
        **summarize("tpot", tpots),
        **summarize("itl", [x for r in done for x in r.itls]),
        **summarize("e2el", [r.e2el for r in done if r.e2el is not None]),
        "kv_cache_usage_after": after.get("kvcore:kv_cache_usage_perc"),
        "leaked_blocks": (after["num_blocks"] - after["kvcore:num_free_blocks"])
        if "num_blocks" in after and "kvcore:num_free_blocks" in after else None,
        "running_after": after.get("kvcore:num_requests_running"),
        "prefix_cache_hit_rate": _delta_ratio(before, after),
    }
    return report


def _delta_ratio(before: dict[str, float], after: dict[str, float]) -> float | None:
    queries = (after.get("kvcore:prefix_cache_queries_total", 0)
               - before.get("kvcore:prefix_cache_queries_total", 0))
    hits = (after.get("kvcore:prefix_cache_hits_total", 0)
            - before.get("kvcore:prefix_cache_hits_total", 0))
    return hits / queries if queries else None


def print_report(report: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    for key, value in report.items():
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<40}{text:>20}")
    print("=" * 60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="the `model` field (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "shared-prefix", "mixed"], default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (after the prefix)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    p.add_argument("--num-groups", type=int, default=8, help="shared-prefix: distinct prefixes")
    p.add_argument("--vocab-size", type=int, default=49152,
                   help="prompt ids are drawn below this (the default model's vocabulary)")
    p.add_argument("--token-id-min", type=int, default=100)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="requests per second, Poisson (default inf: all at once)")
    p.add_argument("--disconnect-fraction", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds without a byte")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.disconnect_fraction <= 1:
        p.error("--disconnect-fraction must be in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report | {"args": {k: v for k, v in vars(args).items()
                                         if k != "api_key"}}, f, indent=2)
    return report


if __name__ == "__main__":
    main()

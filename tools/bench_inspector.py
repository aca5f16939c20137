"""The KV inspector's cost: engine step time with the page open (clients polling /debug/kv, as
the page does, twice a second) against closed, side by side in one run on the default model.

    .venv/bin/python tools/bench_inspector.py [--clients 10] [--requests 16] [--repeats 3]

Runs alternate closed / open on one engine (open: a separate process polls /debug/kv with
`--clients` clients). Reported per mode, the median over the repeats: the wall time per step of
the driver (steps plus everything between them: the snapshot builds included), the engine.step
time alone, and how many snapshots were built and served. The closed runs start more than
POLL_WINDOW_S after the pollers stopped, so no snapshot is built in them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import subprocess
import sys
import time
from typing import Any

import structlog


async def poll(url: str, clients: int, interval_s: float) -> None:
    """`clients` pollers of /debug/kv every interval_s until killed (the page's loop)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession) -> None:
        while True:
            async with session.get(url) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            await asyncio.sleep(interval_s)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session) for _ in range(clients)))


async def run_workload(ae: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    from kvcore.sampling import SamplingParams

    engine = ae.engine
    step, publish = type(engine).step, type(ae._kv_probe).publish
    step_s: list[float] = []
    publish_s: list[float] = []

    def timed_step() -> Any:
        start = time.perf_counter()
        out = step(engine)
        step_s.append(time.perf_counter() - start)
        return out

    def timed_publish(target: Any) -> None:
        start = time.perf_counter()
        publish(ae._kv_probe, target)
        publish_s.append(time.perf_counter() - start)

    engine.step = timed_step  # the driver looks both up at every call
    ae._kv_probe.publish = timed_publish
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        async for out in ae.generate(prompt, params, f"bench-{time.monotonic_ns()}-{i}"):
            last = out
        return len(last.outputs[0].token_ids)

    start, cpu = time.perf_counter(), time.process_time()
    tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    del engine.step, ae._kv_probe.publish
    assert sum(tokens) == len(prompts) * max_tokens
    return {"wall_per_step_ms": 1e3 * wall / len(step_s),
            # the server process's CPU time (all threads): steps, snapshots, serving the polls
            "cpu_per_step_ms": 1e3 * cpu / len(step_s),
            "step_ms": 1e3 * statistics.fmean(step_s), "steps": len(step_s),
            "snapshots": len(publish_s),
            "snapshot_ms": 1e3 * statistics.fmean(publish_s) if publish_s else 0.0}


async def bench(args: argparse.Namespace) -> None:
    from aiohttp import web

    from kvcore.engine import AsyncEngine
    from kvcore.engine.kv_snapshot import POLL_WINDOW_S
    from kvcore.engine.llm import engine_config
    from kvcore.model.hub import resolve_model
    from kvcore.service import make_app

    model_dir = resolve_model(args.model)
    ae = AsyncEngine.from_config(engine_config(str(model_dir), device="cpu"))
    app = make_app(ae, served_model_name="bench")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/debug/kv"
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = ae.engine.model_config.vocab_size
    prefix = rng.integers(10, vocab, args.prompt_len // 2).tolist()  # shared: prefix hits
    results: dict[str, list[dict[str, float]]] = {"closed": [], "open": []}
    served = 0
    try:
        await run_workload(ae, [prefix + [11]], 4)  # warm-up
        for repeat in range(args.repeats):
            for mode in ("closed", "open"):
                prompts = [prefix + rng.integers(10, vocab, args.prompt_len // 2).tolist()
                           for _ in range(args.requests)]
                poller = None
                before_poll = ae._kv_probe._seq
                if mode == "open":
                    poller = subprocess.Popen([sys.executable, __file__, "--poll", url,
                                               "--clients", str(args.clients)])
                    while ae._kv_probe.last is None or ae._kv_probe._seq == before_poll:
                        await asyncio.sleep(0.1)  # the pollers are up and polling
                    await asyncio.sleep(1.0)
                    if poller.poll() is not None:
                        raise RuntimeError("the poller process failed")
                before = ae._kv_probe._seq
                result = await run_workload(ae, prompts, args.max_tokens)
                if poller is not None:
                    if poller.poll() is not None:
                        raise RuntimeError("the poller process failed")
                    poller.terminate()
                    poller.wait()
                    served += ae._kv_probe._seq - before
                    await asyncio.sleep(POLL_WINDOW_S + 1.0)  # publishing stops before closed
                results[mode].append(result)
                print(f"repeat {repeat} {mode:6s} " + " ".join(
                    f"{k}={v:.2f}" for k, v in result.items()), flush=True)
    finally:
        await runner.cleanup()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in results.items()}
    print(f"\nmodel {model_dir.name}, {args.requests} requests x ({args.prompt_len} prompt + "
          f"{args.max_tokens} output) tokens, {ae.engine.kv.num_blocks} blocks, "
          f"{args.clients} clients polling every 0.5 s while open; medians of {args.repeats}")
    print("| page | wall per step (ms) | server CPU per step (ms) | engine.step (ms) | "
          "snapshots built | snapshot build (ms) |")
    print("|---|---|---|---|---|---|")
    for mode in ("closed", "open"):
        m = med[mode]
        print(f"| {mode} | {m['wall_per_step_ms']:.2f} | {m['cpu_per_step_ms']:.2f} | "
              f"{m['step_ms']:.2f} | {m['snapshots']:.0f} | {m['snapshot_ms']:.2f} |")
    for key in ("wall_per_step_ms", "cpu_per_step_ms"):
        ratio = med["open"][key] / med["closed"][key]
        print(f"open / closed {key}: {ratio:.4f} ({100 * (ratio - 1):+.2f}%)")
    # what the driver itself spent on snapshots, as a share of the open runs' wall time
    share = [r["snapshots"] * r["snapshot_ms"] / (r["wall_per_step_ms"] * r["steps"])
             for r in results["open"]]
    print(f"snapshot builds in the driver: {100 * statistics.median(share):.3f}% of the wall "
          f"time; /debug/kv served {served} distinct snapshots")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the default)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the poller process
    args = parser.parse_args()
    if args.poll:
        asyncio.run(poll(args.poll, args.clients, 0.5))
        return
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()

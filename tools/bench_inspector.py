"""The KV inspector's cost: engine step time with the page open (clients polling /debug/kv, as
the page does, twice a second) against closed, side by side in one run on the default model.

    .venv/bin/python tools/bench_inspector.py [--clients 10] [--cycles 16] [--phase-s 10]

One engine serves a steady load (clients sending requests back to back) while the page is
alternately closed and open for --phase-s seconds each (open: a separate process polls /debug/kv
with --clients clients; closed: that process is stopped with SIGSTOP and the engine's poll window
reset, as if the page had been closed for longer than POLL_WINDOW_S). Short alternating phases in
ABBA order pair each open phase with a closed one of the same minute, which is what makes a
comparison possible on a machine whose speed drifts. Per phase: the wall time per step (from one
step's start to the next: the step and everything the driver does between steps, snapshot builds
included), the engine.step time alone, and the snapshot builds.
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


class Recorder:
    """Wraps engine.step and the probe's publish (the driver looks both up at every call) to
    record when each step started, how long it took, and how long each snapshot build took."""

    def __init__(self, ae: Any) -> None:
        engine, probe = ae.engine, ae._kv_probe
        step, publish = type(engine).step, type(probe).publish
        self.steps: list[tuple[float, float]] = []  # (start, duration) in perf_counter seconds
        self.publishes: list[tuple[float, float]] = []

        def timed_step() -> Any:
            start = time.perf_counter()
            out = step(engine)
            self.steps.append((start, time.perf_counter() - start))
            return out

        def timed_publish(target: Any) -> None:
            start = time.perf_counter()
            publish(probe, target)
            self.publishes.append((start, time.perf_counter() - start))

        engine.step = timed_step
        probe.publish = timed_publish


async def steady_load(ae: Any, num: int, prefix: list[int], max_tokens: int,
                      stop: asyncio.Event) -> None:
    """`num` clients that each send a request as soon as the previous one ends."""
    from kvcore.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def client(i: int) -> None:
        call = 0
        while not stop.is_set():
            async for _ in ae.generate(prefix + [11 + i, 12 + call % 100], params):
                pass
            call += 1

    await asyncio.gather(*(client(i) for i in range(num)))


def phase_stats(recorder: Recorder, start: float, end: float) -> dict[str, float]:
    """Steps that started in [start, end): wall per step (start to start: the step and all
    that runs between steps), the engine.step time alone, and the snapshot builds' time."""
    steps = [s for s in recorder.steps if start <= s[0] < end]
    builds = [p for p in recorder.publishes if start <= p[0] < end]
    if len(steps) < 3:
        raise RuntimeError("too few steps in a phase: make --phase-s longer")
    return {"wall_per_step_ms": 1e3 * (steps[-1][0] - steps[0][0]) / (len(steps) - 1),
            "step_ms": 1e3 * statistics.fmean(d for _, d in steps),
            "builds_per_s": len(builds) / (end - start),
            "build_ms": 1e3 * statistics.fmean(d for _, d in builds) if builds else 0.0,
            "build_share": sum(d for _, d in builds) / (end - start)}


async def bench(args: argparse.Namespace) -> None:
    import signal

    from aiohttp import web

    from kvcore.engine import AsyncEngine
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
    recorder = Recorder(ae)
    prefix = list(range(1000, 1000 + args.prompt_len))  # shared by every request: prefix hits
    stop = asyncio.Event()
    load = asyncio.create_task(steady_load(ae, args.requests, prefix, args.max_tokens, stop))
    poller = subprocess.Popen([sys.executable, __file__, "--poll", url,
                               "--clients", str(args.clients)])
    phases: list[tuple[str, float, float]] = []
    try:
        await asyncio.sleep(args.phase_s)  # warm-up, the pollers connect
        for cycle in range(args.cycles):
            # ABBA order so a drift of the machine's speed cancels within each pair of cycles
            for mode in (("closed", "open") if cycle % 2 == 0 else ("open", "closed")):
                if mode == "open":
                    poller.send_signal(signal.SIGCONT)
                else:
                    poller.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(0.3)  # the polls already sent are answered ...
                    ae._kv_probe._polled = float("-inf")  # ... then the page is closed
                start = time.perf_counter()
                await asyncio.sleep(args.phase_s)
                if poller.poll() is not None:
                    raise RuntimeError("the poller process failed")
                # the first second of a phase settles (pollers resume, the last build ends)
                phases.append((mode, start + 1.0, time.perf_counter()))
    finally:
        poller.send_signal(signal.SIGCONT)
        poller.terminate()
        poller.wait()
        stop.set()
        await load
        await runner.cleanup()
    stats = {mode: [phase_stats(recorder, a, b) for m, a, b in phases if m == mode]
             for mode in ("closed", "open")}
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in stats.items()}
    # paired: each open phase against the closed phase of the same cycle
    ratios = [o["wall_per_step_ms"] / c["wall_per_step_ms"]
              for o, c in zip(stats["open"], stats["closed"], strict=True)]
    step_ratios = [o["step_ms"] / c["step_ms"]
                   for o, c in zip(stats["open"], stats["closed"], strict=True)]
    print(f"model {model_dir.name}, {ae.engine.kv.num_blocks} blocks; {args.requests} clients "
          f"back to back, {args.prompt_len}-token shared prefix + 2, {args.max_tokens} output "
          f"tokens; {args.cycles} cycles of {args.phase_s:.0f} s closed + {args.phase_s:.0f} s "
          f"open ({args.clients} clients polling /debug/kv every 0.5 s), medians")
    print("| page | wall per step (ms) | engine.step (ms) | snapshots / s | snapshot build (ms) "
          "| builds' share of the wall time |")
    print("|---|---|---|---|---|---|")
    for mode in ("closed", "open"):
        m = med[mode]
        print(f"| {mode} | {m['wall_per_step_ms']:.1f} | {m['step_ms']:.1f} | "
              f"{m['builds_per_s']:.2f} | {m['build_ms']:.2f} | {100 * m['build_share']:.3f}% |")
    print(f"open / closed, paired by cycle: wall per step median "
          f"{statistics.median(ratios):.4f} (quartiles {_quartiles(ratios)}), engine.step "
          f"median {statistics.median(step_ratios):.4f} (quartiles {_quartiles(step_ratios)})")


def build_only(num_blocks: int, repeats: int) -> None:
    """The snapshot build alone on a pool of num_blocks blocks of 16 tokens, 90% full (256
    sequences through the real scheduler, half of them sharing a prefix, then a quarter freed,
    so the free queue holds cached blocks); no model."""
    import json
    import random

    from kvcore.cache import KVCacheManager
    from kvcore.engine.kv_snapshot import pool_snapshot
    from kvcore.request import Sequence, SequenceStatus
    from kvcore.sampling.params import SamplingParams
    from kvcore.scheduler import Scheduler

    tokens_per_seq = int(num_blocks * 16 * 0.9 / 256)
    scheduler = Scheduler(KVCacheManager(num_blocks, 16), 1 << 30, 256)
    rng = random.Random(0)
    prefix = [rng.randrange(1, 1000) for _ in range(tokens_per_seq // 4)]
    for i in range(256):
        own = [rng.randrange(1, 1000) for _ in range(tokens_per_seq - len(prefix))]
        prompt = (prefix if i % 2 else own[:len(prefix)]) + own
        scheduler.add(Sequence(seq_id=f"r{i}", request_id=f"r{i}", prompt_token_ids=prompt,
                               params=SamplingParams(max_tokens=8), max_tokens=8))
    scheduler.schedule()
    for seq in rng.sample(scheduler.running, 64):
        scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        snapshot = pool_snapshot(scheduler.kv, scheduler)
        times.append(time.perf_counter() - start)
    size = len(json.dumps(snapshot, separators=(",", ":")))
    print(f"| {num_blocks:,} | {scheduler.kv.usage():.0%} | {snapshot['counts']['cached']:,} | "
          f"{1e3 * statistics.median(times):.1f} | {size / 1e3:.0f} KB |")


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"{q[0]:.3f}-{q[2]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the default)")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--requests", type=int, default=8, help="concurrent clients")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cycles", type=int, default=16)
    parser.add_argument("--phase-s", type=float, default=10.0)
    parser.add_argument("--build-only", type=int, nargs="*", metavar="NUM_BLOCKS",
                        help="time the snapshot build alone on pools of these sizes (no model)")
    parser.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the poller process
    args = parser.parse_args()
    if args.build_only:
        print("| blocks | in use | cached | build (ms, median of 5) | JSON |")
        print("|---|---|---|---|---|")
        for num_blocks in args.build_only:
            build_only(num_blocks, 5)
        return
    if args.poll:
        asyncio.run(poll(args.poll, args.clients, 0.5))
        return
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()

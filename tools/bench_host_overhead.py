"""Host overhead per request-step: the real engine around a stub model that does no forward pass.

N concurrent streams (default 256) run through AsyncEngine.generate with the default model's real
tokenizer and incremental detokenizer, greedy, ignore_eos, max_tokens = warm-up + steps. The stub
model's output follows a fixed rule (next token = f(previous token, its position), a precomputed
table), so every stream's tokens and text are checked against an oracle after the timed run.
Two modes:
  logits  the stub returns (L, vocab) float32 logits (rows of a precomputed random table whose
          argmax is the rule's token); the engine's CPU sampler runs greedy over full rows.
  ids     the stub returns the (L,) sampled token ids, the shape of the GPU path where logits
          stay on the device. See `build_engine` for how today's engine is made to take them.
  gpu     GPU-shaped: the ids stub on a fake device, its forward a fixed simulated step time
          (a sleep in the device's worker thread, which releases the GIL, as a CUDA stream runs
          while the host goes on). Reports the fraction of the timed window's wall time the
          "device" is busy, with async scheduling on and off, at each --gpu-step-ms.
The figure is (wall or process CPU time of the timed steps - time inside the stub's forward) /
(request-steps): everything the host does per sequence per step except the forward pass.
Process CPU time counts every thread (the engine steps in a worker thread).

    .venv/bin/python tools/bench_host_overhead.py [--json] [--n 256] [--steps 64]
        [--mode logits|ids|both|gpu] [--gpu-step-ms 2,5,10] [--http] [--flatness 1024]
        [--repeats 3] [--profile 25]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import pstats
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# isort: off
import kvcore  # noqa: F401  (before NumPy: sets OpenBLAS's thread timeout, see kvcore/__init__)
import numpy as np
import structlog
# isort: on

from kvcore.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvcore.model import InputFill
from kvcore.model.tokenizer import Tokenizer
from sim_device import TimelineStream

WARMUP_STEPS = 4  # whole steps of all n streams before the timed ones (the prefill among them)
SLACK_STEPS = 8  # more tokens than timed steps: the streams arrive over the first steps
SLACK_STEPS_HTTP = 48  # HTTP clients connect one by one: their streams arrive over more steps
PROMPT_LEN = 8
BLOCK_SIZE = 16
TABLE_ROWS = 256  # distinct logits rows the stub picks from (50 MB at vocab 49,152)


# --- the stub model: no engine API here beyond BatchInput's fields -------------------------------

class TokenRule:
    """next token = row_token[(prev * 1_000_003 + position) % rows]: deterministic, varied."""

    def __init__(self, vocab_size: int, num_rows: int, with_logits: bool, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.num_rows = num_rows
        if with_logits:
            self.logits = rng.standard_normal((num_rows, vocab_size), np.float32)  # (R, V)
            self.row_token = self.logits.argmax(axis=1)  # (R,) int64
        else:
            self.row_token = rng.integers(0, vocab_size, num_rows)  # (R,) int64

    def rows(self, prev: np.ndarray, positions: np.ndarray) -> np.ndarray:
        return (prev * 1_000_003 + positions) % self.num_rows  # (L,) int64

    def expected(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """The oracle: the tokens a stream with this prompt must produce."""
        seq = list(prompt)
        for _ in range(num_tokens):
            row = self.rows(np.array([seq[-1]]), np.array([len(seq) - 1]))  # (1,)
            seq.append(int(self.row_token[row[0]]))
        return seq[len(prompt):]


class StubModel:
    """A model for the engine: `config` and `forward(batch, kv_cache)`. Returns (L, vocab) logits
    (a view of a reused buffer) or (L,) token ids; records the time spent inside forward so the
    harness can subtract it."""

    def __init__(self, config: ModelConfig, rule: TokenRule, mode: str, max_rows: int,
                 step_s: float = 0.0) -> None:
        self.config = config
        self.rule = rule
        self.mode = mode
        self.step_s = step_s  # a simulated device step (gpu mode): sleeps, holding no GIL
        self._out = (np.empty((max_rows, config.vocab_size), np.float32)  # (max L, V)
                     if mode == "logits" else None)
        self.calls: list[tuple[float, float, float, float, int]] = []
        # (wall end, process CPU end, wall inside, thread CPU inside, rows)

    def forward(self, batch: Any, kv_cache: Any, fill: InputFill | None = None) -> np.ndarray:
        t0, c0 = time.perf_counter(), time.thread_time()
        if fill is not None:  # pending tokens, from the step before's samples
            fill.apply(batch.input_ids)
        sel = batch.logits_indices
        rows = self.rule.rows(batch.input_ids[sel], batch.positions[sel])  # (L,)
        if self.step_s:
            time.sleep(max(0.0, self.step_s - (time.perf_counter() - t0)))
        if self._out is None:
            out = self.rule.row_token[rows]  # (L,) int64
        else:
            # mode="clip": with the default "raise" NumPy buffers `out` (a second copy)
            out = np.take(self.rule.logits, rows, axis=0, out=self._out[:len(rows)],
                          mode="clip")  # (L, V)
        t1, c1 = time.perf_counter(), time.thread_time()
        self.calls.append((t1, time.process_time(), t1 - t0, c1 - c0, len(rows)))
        return out


# --- ENGINE-API GLUE: the only code that knows today's Engine / AsyncEngine / output shapes -----
# After the engine redesign, swap this section; the stub and the harness stay as they are.

def build_engine(model_dir: Path, stub: StubModel, tokenizer: Tokenizer, n: int,
                 max_tokens: int, async_scheduling: bool = False, stream: Any = None) -> Any:
    """An AsyncEngine over the real Engine with the stub model. In ids mode the core's sampler is
    a pass-through of the stub's (L,) token ids (the GPU path's argmax runs on the device):
    excluded from the figure is the sampler's argmax; still included are the core's row loop,
    its gather and the SamplingRow list."""
    from kvcore.engine import AsyncEngine, Engine

    blocks_per_seq = -(-(PROMPT_LEN + max_tokens) // BLOCK_SIZE) + 1
    config = EngineConfig(
        model=str(model_dir), device="cpu", seed=0,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=n * blocks_per_seq),
        scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=max(2048, n * PROMPT_LEN),
                                  max_model_len=PROMPT_LEN + max_tokens),
        async_scheduling=async_scheduling)
    engine = Engine(config, model=stub, tokenizer=tokenizer)
    if stub.step_s:  # the fake device: its forward runs in a worker thread, in launch order
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from fake_device import WorkerStream  # the tests' worker-thread device

        engine.core.runner.stream = WorkerStream()
    elif stream is not None:
        engine.core.runner.stream = stream
    if stub.mode == "ids":
        engine.core.sampler = PassThroughSampler()  # type: ignore[assignment]
    return AsyncEngine(engine)


class PassThroughSampler:
    """The core's sampler for the ids stub: its (L,) token ids are the draw (greedy rows)."""

    def launch(self, token_ids: np.ndarray, rows: Sequence[Any]) -> tuple[Any, Any]:
        from kvcore.sampling import SamplerOutput

        return token_ids, lambda: SamplerOutput(token_ids=token_ids, logprobs=[None] * len(rows))


def greedy_params(max_tokens: int) -> Any:
    from kvcore.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def read_delta(output: Any) -> tuple[list[int], str]:
    """(new token ids, new text) of one streamed output of a single-choice request."""
    choice = output.outputs[0]
    return choice.token_ids, choice.text


def profile_steps(engine: Any) -> cProfile.Profile:
    """A profiler of the engine's steps in the worker thread (a cProfile.Profile sees only the
    thread that enables it, and one profiler must not run in two threads at once)."""
    profiler = cProfile.Profile(time.thread_time)
    inner = engine.engine.step

    def step() -> Any:
        profiler.enable()
        try:
            return inner()
        finally:
            profiler.disable()
    engine.engine.step = step
    return profiler


# the stages of today's step whose cumulative profile time `--profile` reports: (file, function)
STAGES = (
    ("engine.py", "step"), ("core.py", "step"), ("core.py", "_launch"), ("runner.py", "launch"),
    ("core.py", "_collect"), ("core.py", "_append"), ("draw.py", "sampling_row"),
    ("output.py", "process"), ("scheduler.py", "schedule"), ("runner.py", "execute"),
    ("batch.py", "build"), ("bench_host_overhead.py", "forward"), ("scheduler.py", "advance"),
    ("engine.py", "_sample"), ("sampler.py", "__call__"), ("scheduler.py", "append_tokens"),
    ("request.py", "append_token"), ("tokenizer.py", "add"), ("output.py", "add"),
    ("output.py", "delta"), ("output.py", "output"), ("async_engine.py", "_drive"),
    ("queues.py", "put_nowait"),
    ("async_engine.py", "_generate"), ("bench_host_overhead.py", "stream_direct"),
    ("web_protocol.py", "_handle_request"), ("openai_routes.py", "_stream"),
    ("call.py", "_pump"), ("call.py", "deltas"), ("formatter.py", "chunk"),
    ("web_response.py", "write"), ("client_proto.py", "data_received"),
    ("base_events.py", "_run_once"),
)


def make_http_app(engine: Any) -> Any:
    from kvcore.service import make_app

    return make_app(engine, served_model_name="bench")


# --- the harness ---------------------------------------------------------------------------------

async def stream_direct(engine: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    token_ids: list[int] = []
    text: list[str] = []
    async for output in engine.generate(prompt, greedy_params(max_tokens)):
        new_ids, new_text = read_delta(output)
        token_ids.extend(new_ids)
        text.append(new_text)
    return token_ids, "".join(text)


async def run_streams(engine: Any, prompts: list[list[int]], max_tokens: int,
                      http: bool) -> list[tuple[list[int] | None, str]]:
    """Run every stream to its end; per stream (token ids, or None over HTTP; text)."""
    if not http:
        async with engine:
            results = await asyncio.gather(*(stream_direct(engine, p, max_tokens)
                                             for p in prompts))
        return [(ids, text) for ids, text in results]
    from aiohttp import ClientSession, TCPConnector, web

    runner = web.AppRunner(make_http_app(engine))
    await runner.setup()  # starts the engine (the app's cleanup_ctx)
    # a listen backlog above n: at the default 128 the other clients' SYNs are dropped and
    # retried a second later, so the streams would not all be running together
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=len(prompts) + 16)
    await site.start()
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}/v1/completions"
    try:
        async with ClientSession(connector=TCPConnector(limit=0)) as session:
            async def stream_http(prompt: list[int]) -> bytes:
                body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": True}
                async with session.post(url, json=body) as resp:
                    assert resp.status == 200, (resp.status, await resp.text())
                    return b"".join([chunk async for chunk in resp.content.iter_any()])
            raw = await asyncio.gather(*(stream_http(p) for p in prompts))
    finally:
        await runner.cleanup()
    return [(None, sse_text(body)) for body in raw]


def sse_text(body: bytes) -> str:
    """The streamed completion text of one SSE body (parsed after the timed run)."""
    events = [e[len(b"data: "):] for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", body[-200:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def timed_window(calls: list[tuple[float, float, float, float, int]], n: int,
                 steps: int) -> tuple[float, float, float]:
    """(wall, process CPU, stub wall) of `steps` whole steps of n rows after WARMUP_STEPS of them.
    The window runs from the end of one forward call to the end of the call `steps` later, so it
    holds `steps` times the host work of a step (output processing of one, scheduling and batch
    building of the next) plus the forward calls, which are subtracted."""
    first = next(i for i, c in enumerate(calls) if c[4] == n)  # every stream has been added
    k0 = first + WARMUP_STEPS - 1
    k1 = k0 + steps
    if k1 >= len(calls) or any(c[4] != n for c in calls[k0:k1 + 1]):
        raise RuntimeError(f"no {steps} steps of all {n} streams after the warm-up: rows per "
                           f"step {[c[4] for c in calls]}")
    timed = calls[k0 + 1:k1 + 1]
    forward_wall = sum(c[2] for c in timed)
    wall = calls[k1][0] - calls[k0][0] - forward_wall
    cpu = calls[k1][1] - calls[k0][1] - sum(c[3] for c in timed)
    return wall, cpu, forward_wall


def measure(model_dir: Path, tokenizer: Tokenizer, rule: TokenRule, mode: str, n: int,
            steps: int, http: bool, profile: int, step_s: float = 0.0,
            async_scheduling: bool = False, device: str = "timeline") -> dict[str, float]:
    """`step_s` > 0: the GPU-shaped fake device, "timeline" (sim_device.TimelineStream) or
    "thread" (the stub sleeps step_s in a WorkerStream's thread)."""
    max_tokens = WARMUP_STEPS + steps + (SLACK_STEPS_HTTP if http else SLACK_STEPS)
    config = dataclasses.replace(ModelConfig.from_dir(model_dir), num_layers=1)  # a small KV pool
    timeline = TimelineStream(step_s) if step_s and device == "timeline" else None
    stub = StubModel(config, rule, mode, n, step_s if timeline is None else 0.0)
    engine = build_engine(model_dir, stub, tokenizer, n, max_tokens, async_scheduling, timeline)
    rng = np.random.default_rng(n)
    prompts = [rng.integers(0, config.vocab_size, PROMPT_LEN).tolist() for _ in range(n)]
    # thread CPU time as the timer: wall-clock own times on a shared machine include waits
    profilers = [cProfile.Profile(time.thread_time), profile_steps(engine)] if profile else []
    if profilers:
        profilers[0].enable()
    results = asyncio.run(run_streams(engine, prompts, max_tokens, http))
    if profilers:
        profilers[0].disable()
        print_profile(profilers, profile)
    # a fast wrong engine is worth nothing: every stream got the oracle's tokens and their text
    for prompt, (token_ids, text) in zip(prompts, results, strict=True):
        expected = rule.expected(prompt, max_tokens)
        assert token_ids is None or token_ids == expected, (prompt, token_ids, expected)
        assert text == tokenizer.decode(expected), (prompt, text)
    wall, cpu, forward_wall = timed_window(stub.calls, n, steps)
    if timeline is not None:  # the device's time is the simulated one, one span per call
        spans = [(end, end, end - start, 0.0, call[4])
                 for (start, end), call in zip(timeline.spans, stub.calls, strict=True)]
        wall, _, forward_wall = timed_window(spans, n, steps)
    per = 1e6 / (n * steps)
    # busy: the device's share of the window (wall here is the time it waited for the host)
    return {"wall": wall * per, "cpu": cpu * per, "forward_wall": forward_wall * per,
            "busy": forward_wall / (wall + forward_wall)}


def print_profile(profilers: list[cProfile.Profile], top: int) -> None:
    stats = pstats.Stats(profilers[0], stream=sys.stderr)
    stats.add(profilers[1])
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"profile (cProfile, thread CPU time, event loop + step thread, whole run incl. "
          f"warm-up and the stub): {total:.3f} s; top functions by own time:", file=sys.stderr)
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in sorted(
            entries, key=lambda kv: -kv[1][2])[:top]:
        print(f"  {100 * tottime / total:5.1f}%  own {tottime:7.3f}s  cum {cumtime:7.3f}s  "
              f"{ncalls:>8}  {Path(path).name}:{line} {name}", file=sys.stderr)
    print("stages (cumulative time; a coroutine's counts only its running slices):",
          file=sys.stderr)
    for file, function in STAGES:
        cum = sum(v[3] for (path, _, name), v in entries
                  if name == function and Path(path).name == file)
        if cum:
            print(f"  {100 * cum / total:5.1f}%  cum {cum:7.3f}s  {file} {function}",
                  file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="concurrent streams")
    parser.add_argument("--steps", type=int, default=64, help="timed steps (after warm-up)")
    parser.add_argument("--mode", choices=("logits", "ids", "both", "gpu"), default="both")
    parser.add_argument("--gpu-step-ms", default="2,5,10", metavar="MS,...",
                        help="gpu mode: the simulated device step times (default 2,5,10)")
    parser.add_argument("--gpu-device", choices=("timeline", "thread"), default="timeline",
                        help="gpu mode: a simulated stream (default), or a worker thread that "
                             "sleeps (it needs the GIL to start each step, a GPU does not)")
    parser.add_argument("--http", action="store_true",
                        help="through the aiohttp SSE path (in-process clients); keys end _http")
    parser.add_argument("--flatness", type=int, metavar="N2",
                        help="also run at N2 streams and report figure(N2) / figure(n)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per figure; the median is reported (a noisy machine)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="print the TOP functions of a cProfile of each run (slows it)")
    parser.add_argument("--model", type=Path, help="model directory (default: the default model)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("n", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    from kvcore.model.hub import resolve_model

    model_dir = resolve_model(None if args.model is None else str(args.model))
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    modes = ("logits", "ids") if args.mode == "both" else (args.mode,)
    suffix = "_http" if args.http else ""
    report: dict[str, Any] = {"n": args.n, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
                              "repeats": args.repeats, "path": "http" if args.http else "direct"}
    if args.mode == "gpu":
        report.update(gpu_shaped(args, model_dir, tokenizer, vocab_size, suffix))
        modes = ()
    for mode in modes:
        rule = TokenRule(vocab_size, TABLE_ROWS, with_logits=mode == "logits")
        key = f"us_per_request_step_{mode}{suffix}"
        for n, label in ((args.n, ""), (args.flatness, "_at_flatness_n")):
            if n is None:
                continue
            figs = [measure(model_dir, tokenizer, rule, mode, n, args.steps, args.http,
                            args.profile) for _ in range(args.repeats)]
            for name, field in ((key, "wall"), (key + "_cpu", "cpu"),
                                (f"stub_forward_us_per_request_step_{mode}", "forward_wall")):
                report[name + label] = round(float(np.median([f[field] for f in figs])), 2)
        if args.flatness is not None:
            report["flatness_n"] = args.flatness
            for kind in ("", "_cpu"):
                report[f"flatness_{mode}{suffix}{kind}"] = round(
                    report[key + kind + "_at_flatness_n"] / report[key + kind], 3)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>48}: {value}")
    return report


def gpu_shaped(args: argparse.Namespace, model_dir: Path, tokenizer: Tokenizer,
               vocab_size: int, suffix: str) -> dict[str, Any]:
    """The device-busy fraction (median of --repeats), async scheduling off and on, per
    simulated step; and the host's CPU time per request-step (every thread but the device's)."""
    try:
        step_ms = [float(x) for x in args.gpu_step_ms.split(",")]
    except ValueError:
        raise ValueError(f"gpu_step_ms must be comma-separated numbers, "
                         f"got {args.gpu_step_ms!r}") from None
    if not step_ms or min(step_ms) <= 0:
        raise ValueError(f"gpu_step_ms must be positive, got {args.gpu_step_ms!r}")
    rule = TokenRule(vocab_size, TABLE_ROWS, with_logits=False)
    report: dict[str, Any] = {"gpu_step_ms": step_ms, "gpu_device": args.gpu_device}
    for ms in step_ms:
        for name, on in (("off", False), ("on", True)):
            figs = [measure(model_dir, tokenizer, rule, "ids", args.n, args.steps, args.http,
                            args.profile, ms / 1e3, on, args.gpu_device)
                    for _ in range(args.repeats)]
            key = f"{ms:g}ms_async_{name}{suffix}"
            report[f"gpu_busy_{key}"] = round(float(np.median([f["busy"] for f in figs])), 3)
            report[f"gpu_host_cpu_us_per_request_step_{key}"] = round(
                float(np.median([f["cpu"] for f in figs])), 2)
            report[f"gpu_step_wall_ms_{key}"] = round(float(np.median(
                [(f["wall"] + f["forward_wall"]) * args.n / 1e3 for f in figs])), 3)
    return report


if __name__ == "__main__":
    # the engine's info lines would drown the table; only when run as a script, since
    # structlog's configuration is global (a test calling main() keeps the suite's)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    main()

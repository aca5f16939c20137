"""Scheduler overhead per request-step with N running requests, with a stub model.

Each step is what the engine core does around the forward pass: schedule() (budget, KV slots
through the real KVCacheManager), advance(), and each sampled token's Sequence.append_token
(stop checks; a finished sequence is freed). The stub model
'samples' a fixed token, so only the scheduler's work is timed. Target: <= 2 us per request-step.
Several sizes run side by side in one process (`--num-requests 256 1024 4096`).

Warm-up: every prompt is admitted and prefilled in ONE step (a warm-up max_num_batched_tokens of
N * prompt_len tokens). With the steady-state budget, max(2048, N), the decode-first order
leaves only N - running tokens per step for new prompts, so admitting N requests takes about
(N / prompt_len) * ln(prompt_len) + prompt_len * H(prompt_len) steps (~565 at N = 4,096) while the
first ones keep decoding; with the old default steps they then hit max_tokens inside the timed
loop, and with fewer steps they finished during the warm-up and the warm-up loop never ended.

    .venv/bin/python tools/bench_scheduler.py [--num-requests 256 [1024 4096]] [--steps 2000]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import structlog

from kvcore.cache import KVCacheManager
from kvcore.request import Sequence
from kvcore.sampling import SamplingParams
from kvcore.scheduler import Scheduler, SchedulerOutput

MAX_WARMUP_STEPS = 4  # the one-step prefill; more means something is wrong: fail, do not spin


def warm_scheduler(n: int, steps: int, prompt_len: int, block_size: int) -> Scheduler:
    """n running requests, each prefilled and holding one sampled token, room for steps more."""
    max_tokens = steps + 64
    max_len = prompt_len + max_tokens
    num_blocks = n * (-(-max_len // block_size) + 1)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=max(2048, n), max_num_seqs=n)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        scheduler.add(Sequence(seq_id=f"r{i}", request_id=f"r{i}", prompt_token_ids=prompt,
                               params=params, max_tokens=max_tokens))
    steady = scheduler.max_num_batched_tokens
    scheduler.max_num_batched_tokens = n * prompt_len  # the warm-up admits every prompt at once
    for _ in range(MAX_WARMUP_STEPS):
        out = scheduler.schedule()
        scheduler.advance(out)
        append(scheduler, out)
        if len(scheduler.running) == n and all(r.num_output_tokens for r in scheduler.running):
            scheduler.max_num_batched_tokens = steady
            return scheduler
    raise RuntimeError(f"{len(scheduler.running)} of {n} requests running after "
                       f"{MAX_WARMUP_STEPS} warm-up steps ({len(scheduler.waiting)} waiting)")


def append(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine core does with the sampled tokens: the stub 'samples' token 17."""
    seqs = scheduler.seqs
    for item in out.scheduled:
        if item.sample:
            seq = seqs[item.seq_id]
            status = seq.append_token(17)
            if status is not None:
                scheduler.finish(seq, status)


def measure(n: int, steps: int, prompt_len: int, block_size: int, progress: bool
            ) -> dict[str, float]:
    scheduler = warm_scheduler(n, steps, prompt_len, block_size)
    t_schedule = t_update = 0.0
    request_steps = 0
    cpu_start = time.process_time()  # CPU time too: wall time on a shared machine includes waits
    for step in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        scheduler.advance(out)
        append(scheduler, out)
        t2 = time.perf_counter()
        t_schedule += t1 - t0
        t_update += t2 - t1
        request_steps += len(out.scheduled)
        if progress and (step + 1) % max(1, steps // 10) == 0:
            print(f"  n={n}: step {step + 1}/{steps}", file=sys.stderr)
    cpu = time.process_time() - cpu_start
    assert request_steps == n * steps, (request_steps, n * steps, scheduler.num_preemptions,
                                        len(scheduler.running), len(scheduler.waiting))
    per = 1e6 / request_steps
    return {"schedule": t_schedule * per, "update": t_update * per,
            "total": (t_schedule + t_update) * per, "total_cpu": cpu * per,
            "ms_per_step": (t_schedule + t_update) / steps * 1e3}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, nargs="+", default=[256])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--progress", action="store_true", help="print progress to stderr")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for name in ("steps", "prompt_len", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if min(args.num_requests) < 1:
        raise ValueError(f"num_requests must be >= 1, got {args.num_requests}")
    runs = {n: measure(n, args.steps, args.prompt_len, args.block_size, args.progress)
            for n in args.num_requests}
    report: dict[str, Any] = {
        "steps": args.steps, "prompt_len": args.prompt_len, "block_size": args.block_size,
        "runs": [{"n": n, **{k: round(v, 3) for k, v in run.items()}} for n, run in runs.items()]}
    if args.json:
        print(json.dumps(report))
        return report
    print(f"steps: {args.steps}, prompt_len: {args.prompt_len}, block_size: {args.block_size}; "
          "us per request-step")
    print(f"{'running':>8} {'schedule()':>11} {'advance+append':>15} {'total':>7} "
          f"{'total CPU':>10} {'ms/step':>8}")
    for n, run in runs.items():
        print(f"{n:>8} {run['schedule']:>11.2f} {run['update']:>15.2f} {run['total']:>7.2f} "
              f"{run['total_cpu']:>10.2f} {run['ms_per_step']:>8.3f}")
    return report


if __name__ == "__main__":
    # the engine's info lines would drown the table; only when run as a script, since
    # structlog's configuration is global (a test calling main() keeps the suite's)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    main()

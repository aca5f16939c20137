"""Scheduler overhead per request-step at 256 running requests, with a stub model.

Each step is what the engine does around the forward pass: schedule() (budget, KV slots through
the real KVCacheManager), advance() and append_tokens() (stop checks, frees). The stub model
'samples' a fixed token, so only the scheduler's work is timed. Target: <= 2 us per request-step.

    .venv/bin/python tools/bench_scheduler.py [--num-requests 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import time

import structlog

from kvcore.cache import KVCacheManager
from kvcore.request import Request
from kvcore.sampling import SamplingParams
from kvcore.scheduler import Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

    n, steps = args.num_requests, args.steps
    max_len = args.prompt_len + steps + 64
    num_blocks = n * (-(-max_len // args.block_size) + 1)
    kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_num_batched_tokens=max(2048, n), max_num_seqs=n,
                          max_model_len=max_len)
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(n):
        prompt = [(i * 7919 + j) % 32000 for j in range(args.prompt_len)]
        scheduler.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, params=params,
                                      max_tokens=steps + 64))
    # prefill everything first, so the timed steps are all decode steps of n requests
    while len(scheduler.running) < n or any(r.num_output_tokens == 0 for r in scheduler.running):
        out = scheduler.schedule()
        scheduler.advance(out)
        scheduler.append_tokens({rid: 17 for rid, _ in out.scheduled
                                 if scheduler.requests[rid].num_computed_tokens
                                 == scheduler.requests[rid].num_tokens})

    t_schedule = t_update = 0.0
    request_steps = 0
    cpu_start = time.process_time()  # CPU time too: wall time on a shared machine includes waits
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        scheduler.advance(out)
        scheduler.append_tokens(dict.fromkeys([rid for rid, _ in out.scheduled], 17))
        t2 = time.perf_counter()
        t_schedule += t1 - t0
        t_update += t2 - t1
        request_steps += len(out.scheduled)
    assert request_steps == n * steps, (request_steps, n * steps, scheduler.num_preemptions,
                                        len(scheduler.running), len(scheduler.waiting))
    cpu = time.process_time() - cpu_start
    per = 1e6 / request_steps
    print(f"running requests: {n}, steps: {steps}, block_size: {args.block_size}")
    print(f"schedule():            {t_schedule * per:.2f} us per request-step")
    print(f"advance()+append():    {t_update * per:.2f} us per request-step")
    print(f"total:                 {(t_schedule + t_update) * per:.2f} us per request-step "
          f"({(t_schedule + t_update) / steps * 1e3:.3f} ms per step)")
    print(f"total, CPU time:       {cpu * per:.2f} us per request-step")


if __name__ == "__main__":
    main()

"""One stream's decode on the CPU: the fused decode step against the per-op path, side by side in
one run (each in its own engine, KVCORE_CPU_FUSED toggled per engine), the default model unless
--model. Prints the decode step's median and mean wall time, tokens/s and the process's CPU
seconds per wall second while decoding.

    flock /tmp/kvcore-bench.lock .venv/bin/python tools/bench_cpu_decode.py --tokens 200
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.model.cpu_decode import enabled
from kvcore.sampling import SamplingParams


def decode(engine: Engine, prompt: list[int], tokens: int, tag: str) -> tuple[list[float], float]:
    """Per-step wall seconds of one request's decode steps and its CPU / wall ratio."""
    engine.add_request(tag, prompt, SamplingParams(max_tokens=tokens, temperature=0.0,
                                                   ignore_eos=True))
    steps = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps[1:], (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path.home() / ".cache/kvcore/models/"
                                               "SmolLM2-135M-Instruct"))
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    print("load average before:", Path("/proc/loadavg").read_text().split()[:3])
    for fused in ("1", "0"):
        os.environ["KVCORE_CPU_FUSED"] = fused
        engine = Engine(engine_config(args.model, seed=0))
        decode(engine, prompt, 8, "warm")
        steps, busy = decode(engine, prompt, args.tokens, "run")
        path = "fused" if engine.model.fused is not None else "per-op"  # type: ignore[attr-defined]
        print(f"{path:6s} (KVCORE_CPU_FUSED={fused}, enabled={enabled()}): decode step median "
              f"{statistics.median(steps) * 1e3:.2f} ms, mean {statistics.mean(steps) * 1e3:.2f} "
              f"ms, {len(steps) / sum(steps):.1f} tok/s, CPU/wall {busy:.2f}", flush=True)


if __name__ == "__main__":
    main()

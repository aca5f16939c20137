"""Speculative decoding, side by side in one run: speculation off / ngram / suffix on the two
workloads of tools/spec_workloads.py (input-grounded and open chat), at 1 and 8 streams.

The prompts run in rounds of `streams` requests (chat template, greedy unless --temperature);
each round runs under every method in turn (the order rotates), so the machine's noise falls
on all of them alike. Before any figure is reported, every request's tokens under ngram and
suffix are checked against its tokens with speculation off (they must be identical). Reports
output tokens/s, the ratio to off, the acceptance rate (accepted / drafted tokens), the mean
accepted length (tokens a verifying step emits: 1 + accepted per draft), and p50 / p99
inter-token latency (a step that emits n tokens of a request after a gap g counts n gaps of
g / n), and what each speculating engine learnt from its step times (a step without drafts,
and a draft row's cost relative to it, by batch size).

    .venv/bin/python tools/bench_spec.py [--model DIR | --like DIR] [--device cpu|cuda]
        [--num-prompts 32] [--max-tokens 128] [--streams 1,8] [--workloads grounded,chat]
        [--methods off,ngram,suffix] [--json]

`--like DIR`: random weights of DIR's shape (tools/gpu_e2e.py's; the GPU machine gets no real
weights): the figures then measure what verification costs and that outputs stay identical,
not what real drafts gain. A stream count above --num-prompts cycles the prompts to fill it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# isort: off
import kvcore  # noqa: F401  (before NumPy: sets OpenBLAS's thread timeout, see kvcore/__init__)
import numpy as np
import structlog
# isort: on

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_workloads import WORKLOADS  # noqa: E402

SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                   "prompt_lookup_min": 2}}


@dataclass
class Tally:
    seconds: float = 0.0
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    tokens: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> output ids


def run_round(engine: Any, prompts: dict[int, str], params: Any, tally: Tally) -> None:
    """Run the round's requests together to the end; add its figures to `tally`."""
    spec = engine.stats().spec_decode
    before = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else None
    start = time.perf_counter()
    last: dict[str, float] = {}
    for i, prompt in prompts.items():
        engine.add_request(f"p{i}", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            num_new = len(out.outputs[0].token_ids)
            if num_new and out.request_id in last:
                tally.gaps.extend([(now - last[out.request_id]) / num_new] * num_new)
            last[out.request_id] = now
            tally.tokens.setdefault(int(out.request_id[1:]), []).extend(out.outputs[0].token_ids)
            tally.num_tokens += num_new
    tally.seconds += time.perf_counter() - start
    spec = engine.stats().spec_decode
    if spec is not None and before is not None:
        tally.num_drafts += spec.num_drafts - before[0]
        tally.num_draft_tokens += spec.num_draft_tokens - before[1]
        tally.num_accepted += spec.num_accepted_tokens - before[2]


def bench(model_dir: str, args: argparse.Namespace
          ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kvcore.engine import Engine
    from kvcore.engine.llm import engine_config
    from kvcore.sampling import SamplingParams

    streams = [int(s) for s in args.streams.split(",")]
    engines = {method: Engine(engine_config(
        model_dir, device=args.device, max_num_seqs=max(streams), seed=0,
        speculative_config=SPEC.get(method))) for method in args.methods.split(",")}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=0 if args.temperature else None)
    for engine in engines.values():  # warm-up: kernels, allocator
        engine.add_request("warm", "Hello", SamplingParams(max_tokens=8))
        while engine.has_unfinished_requests():
            engine.step()
    rows = []
    for workload in args.workloads.split(","):
        template = next(iter(engines.values())).tokenizer.apply_chat_template
        texts = WORKLOADS[workload][:args.num_prompts]
        for num_streams in streams:
            prompts = [template([{"role": "user", "content": texts[i % len(texts)]}])
                       for i in range(max(len(texts), num_streams))]
            tallies = {method: Tally() for method in engines}
            order = list(engines)
            for r, first in enumerate(range(0, len(prompts), num_streams)):
                batch = {i: prompts[i] for i in range(first, min(first + num_streams,
                                                                  len(prompts)))}
                for method in order[r % len(order):] + order[:r % len(order)]:
                    run_round(engines[method], batch, params, tallies[method])
            rows.extend(report(workload, num_streams, tallies))
    return rows, {method: step_costs(engine) for method, engine in engines.items()
                  if engine.core.speculator is not None}


def step_costs(engine: Any) -> dict[str, Any]:
    """What the speculator learnt from the step times, by batch size: a step without drafts
    (ms) and a draft row's cost relative to it."""
    cost = engine.core.speculator.cost
    return {"step_ms": {b: round(s * 1000, 1) for b, s in sorted(cost.base.items())},
            "draft_row_cost": {b: round(c, 3) for b, c in sorted(cost.row_cost.items())}}


def report(workload: str, num_streams: int, tallies: dict[str, Tally]) -> list[dict[str, Any]]:
    """One row per method; `mismatched_requests`: requests whose tokens differ from off's."""
    base = tallies.get("off")
    rows = []
    for method, t in tallies.items():
        mismatched = (sum(t.tokens[i] != base.tokens[i] for i in base.tokens)
                      if base is not None else None)
        rate = t.num_tokens / t.seconds
        gaps = np.array(t.gaps) * 1000 if t.gaps else np.zeros(1)
        rows.append({
            "workload": workload, "streams": num_streams, "method": method,
            "output_tok_s": round(rate, 2),
            "speedup": round(rate / (base.num_tokens / base.seconds), 3) if base else None,
            "acceptance": round(t.num_accepted / t.num_draft_tokens, 3)
            if t.num_draft_tokens else None,
            "mean_accepted_len": round(1 + t.num_accepted / t.num_drafts, 2)
            if t.num_drafts else None,
            "itl_p50_ms": round(float(np.percentile(gaps, 50)), 1),
            "itl_p99_ms": round(float(np.percentile(gaps, 99)), 1),
            "num_tokens": t.num_tokens, "num_requests": len(t.tokens),
            "mismatched_requests": mismatched})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="model directory (default: the default "
                        "model)")
    source.add_argument("--like", help="config.json + tokenizer directory: random weights")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--workloads", default="grounded,chat")
    parser.add_argument("--methods", default="off,ngram,suffix")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from threadpoolctl import threadpool_info

    from kvcore.model.hub import resolve_model

    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
            f"threads={i.get('num_threads')}" for i in threadpool_info()]
    with tempfile.TemporaryDirectory() as tmp:
        if args.like:
            from gpu_e2e import random_model

            model_dir = str(random_model(Path(args.like), Path(tmp) / "m"))
        else:
            model_dir = str(resolve_model(args.model))
        rows, costs = bench(model_dir, args)
    if args.json:
        print(json.dumps({"blas": blas, "rows": rows, "step_costs": costs}, indent=1))
        return 0
    print(f"BLAS: {'; '.join(blas)}")
    print(f"learnt step costs by batch size: {json.dumps(costs)}")
    print("| workload | streams | method | output tok/s | vs off | acceptance | mean accepted "
          "len | ITL p50 ms | ITL p99 ms | identical to off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "-" if r["mismatched_requests"] is None else (
            f"{r['num_requests'] - r['mismatched_requests']}/{r['num_requests']}")
        print(f"| {r['workload']} | {r['streams']} | {r['method']} | {r['output_tok_s']} | "
              f"{r['speedup']}x | {r['acceptance'] if r['acceptance'] is not None else '-'} | "
              f"{r['mean_accepted_len'] or '-'} | {r['itl_p50_ms']} | {r['itl_p99_ms']} | "
              f"{same} |")
    return 0 if all(not r["mismatched_requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

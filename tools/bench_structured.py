"""What structured outputs cost, on the default model's vocabulary (49,152 tokens).

1. throughput: N concurrent greedy requests (default 64) with a JSON schema vs the same
   requests unconstrained, on the default model (CPU): output tokens/s of each and the ratio,
   ABAB rounds in one run; whole runs (prefill included: the JSON answers are shorter, so their
   prefill weighs more) and the decode steps alone (after every request has its first
   token). Every constrained output that ends "stop" is validated with jsonschema before any
   figure is reported.
2. mask: the seconds one step's masks take (llguidance's parallel fill, mid-object matchers) at
   batch 1, 64 and 256, and the numba apply of those masks to (B, V) logits.
3. gpu: a simulated GPU step (a sleep of --step-ms in the fake device's worker thread, as a CUDA
   stream runs while the host goes on) under the real engine with async scheduling, every row
   constrained vs none: the fraction of the timed window's wall time the device is busy. The
   stub's logits come from a fixed random table; the draw runs on the fake device's thread after
   the sleep (on a GPU it is device work too), so it counts as idle device time here: a
   pessimistic figure. Every constrained output is checked against a fresh matcher.

    .venv/bin/python tools/bench_structured.py [--n 64] [--max-tokens 48] [--rounds 2]
        [--batches 1,64,256] [--gpu-n 16,64] [--step-ms 5] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

# isort: off
import kvcore  # noqa: F401  (before NumPy: sets OpenBLAS's thread timeout)
import numpy as np
import structlog
# isort: on

from kvcore.config import ModelConfig
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.kernels.token_mask import apply_token_bitmask
from kvcore.model import InputFill
from kvcore.model.hub import ensure_default_model
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling import SamplingParams
from kvcore.sampling.constraints import Constraint, ConstraintCompiler
from kvcore.sampling.masks import MaskFiller

SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                          "maximum": 120},
    "city": {"type": "string", "maxLength": 24},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
EXAMPLE = '{"name":"Ada Lovelace","age":36,"city":"London","hobbies":["math","poetry"]}'
PROMPT = ("Describe a fictional person as a JSON object with their name, age, city and "
          "hobbies.")
WARMUP_STEPS = 4


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams
        ) -> tuple[float, Any, tuple[float, int]]:
    """(wall, finished outputs, (decode wall, decode tokens)): decode = the steps after every
    request has its first token (no prefill left in them)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", prompt, params)
    outputs = []
    started: set[str] = set()
    decode_wall, decode_tokens = 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        decoding = len(started) == len(prompts)
        step = engine.step()
        if decoding:
            decode_wall += time.perf_counter() - t0
            decode_tokens += sum(len(c.delta_token_ids) for o in step for c in o.outputs)
        started |= {o.request_id for o in step}
        outputs += [o for o in step if o.finished]
    return time.perf_counter() - start, outputs, (decode_wall, decode_tokens)


def throughput(model_dir: Path, n: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    import jsonschema

    engine = Engine(engine_config(str(model_dir), device="cpu", max_num_seqs=n,
                                  max_num_batched_tokens=4096))
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    prompts = [tokenizer.encode(text + " " * (i % 4)) for i in range(n)]  # 4 prompt variants
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                 constraint=Constraint.json_schema(SCHEMA))
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    run(engine, prompts[:2], dataclasses.replace(constrained, max_tokens=4))  # warm-up
    figures: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    decode: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    num_valid = num_length = 0
    for _ in range(rounds):
        for name, params in (("json_schema", constrained), ("unconstrained", free)):
            wall, outputs, (decode_wall, decode_tokens) = run(engine, prompts, params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            figures[name].append(tokens / wall)
            decode[name].append(decode_tokens / decode_wall)
            if name == "json_schema":
                for o in outputs:
                    if o.outputs[0].finish_reason == "stop":
                        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
                        num_valid += 1
                    else:
                        num_length += 1
    med = {k: float(np.median(v)) for k, v in figures.items()}
    dec = {k: float(np.median(v)) for k, v in decode.items()}
    return {"n": n, "max_tokens": max_tokens, "rounds": rounds,
            "tok_s_json_schema": round(med["json_schema"], 1),
            "tok_s_unconstrained": round(med["unconstrained"], 1),
            "ratio": round(med["json_schema"] / med["unconstrained"], 3),
            "decode_tok_s_json_schema": round(dec["json_schema"], 1),
            "decode_tok_s_unconstrained": round(dec["unconstrained"], 1),
            "decode_ratio": round(dec["json_schema"] / dec["unconstrained"], 3),
            "valid_outputs": num_valid, "length_outputs": num_length}


def mid_object_matchers(compiler: ConstraintCompiler, tokenizer: Tokenizer, num: int) -> list[Any]:
    ids = tokenizer.encode(EXAMPLE)
    constraint = Constraint.json_schema(SCHEMA)
    matchers = []
    for i in range(num):
        matcher = compiler.matcher(constraint)
        for token_id in ids[:1 + i % (len(ids) - 1)]:  # every position of the example
            matcher.consume(token_id)
        matchers.append(matcher)
    return matchers


def mask_times(model_dir: Path, batches: list[int], repeats: int = 20) -> dict[str, Any]:
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    compiler = ConstraintCompiler(tokenizer.to_json, vocab_size, [tokenizer.eos_token_id or 0])
    filler = MaskFiller(vocab_size)
    report: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    for batch in batches:
        matchers = mid_object_matchers(compiler, tokenizer, batch)
        fills, applies = [], []
        logits = rng.standard_normal((batch, vocab_size), dtype=np.float32)
        rows = np.arange(batch, dtype=np.int64)
        for _ in range(repeats):
            t0 = time.perf_counter()
            masks = filler.fill(matchers)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, rows, masks)
            t2 = time.perf_counter()
            fills.append(t1 - t0)
            applies.append(t2 - t1)
        report[f"mask_fill_ms_batch_{batch}"] = round(float(np.median(fills)) * 1e3, 3)
        report[f"mask_apply_ms_batch_{batch}"] = round(float(np.median(applies)) * 1e3, 3)
    return report


class SleepModel:
    """The fake GPU: forward sleeps `step_s` (no GIL held), then gives rows of a fixed random
    logits table chosen by (previous token, position)."""

    def __init__(self, config: ModelConfig, step_s: float, max_rows: int) -> None:
        self.config = config
        self.step_s = step_s
        self.table = np.random.default_rng(0).standard_normal((64, config.vocab_size),
                                                              dtype=np.float32)  # (64, V)
        self.out = np.empty((max_rows, config.vocab_size), np.float32)  # (max L, V)
        self.spans: list[tuple[float, float]] = []  # (start, end) of each simulated step

    def forward(self, batch: Any, kv_cache: Any, fill: InputFill | None = None) -> np.ndarray:
        start = time.perf_counter()
        if fill is not None:  # pending tokens, from the step before's samples
            fill.apply(batch.input_ids)
        sel = batch.logits_indices
        rows = (batch.input_ids[sel] * 31 + batch.positions[sel]) % len(self.table)  # (L,)
        out = np.take(self.table, rows, axis=0, out=self.out[:len(rows)], mode="clip")
        time.sleep(max(0.0, self.step_s - (time.perf_counter() - start)))
        self.spans.append((start, time.perf_counter()))
        return out


def gpu_busy(model_dir: Path, n: int, step_ms: float, steps: int,
             constrained: bool) -> tuple[float, float]:
    """(device busy fraction of the timed window, the draws' mean wait for masks per step)"""
    config = dataclasses.replace(ModelConfig.from_dir(model_dir), num_layers=1)
    model = SleepModel(config, step_ms / 1e3, n)
    max_tokens = WARMUP_STEPS + steps + 4
    engine = Engine(engine_config(str(model_dir), device="cpu", max_num_seqs=n, block_size=16,
                                  num_blocks=n * (max_tokens // 16 + 3),
                                  async_scheduling=True), model=model,
                    tokenizer=Tokenizer.from_dir(model_dir))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from fake_device import WorkerStream  # the tests' worker-thread device

    engine.core.runner.stream = WorkerStream()
    constraint = Constraint.json_schema(SCHEMA)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
                            constraint=constraint if constrained else None)
    prompts = [[1, 2 + i % 7, 3 + i] for i in range(n)]
    engine.constraints.matcher(constraint)  # llguidance's tokenizer and the grammar, untimed
    _ = engine.core.constrainer.filler
    _, outputs, _ = run(engine, prompts, params)
    if constrained:  # validate before reporting: each output is a path through the grammar
        for o in outputs:
            matcher = engine.constraints.matcher(constraint)
            for token_id in o.outputs[0].token_ids:
                matcher.consume(token_id)
    spans = model.spans[WARMUP_STEPS:WARMUP_STEPS + steps]
    window = spans[-1][1] - spans[0][0]
    wait = engine.core.constrainer.wait_seconds / len(model.spans)
    return sum(end - start for start, end in spans) / window, wait


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--gpu-n", default="16,64,256")
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--gpu-steps", type=int, default=24)
    parser.add_argument("--skip", default="", help="comma-separated parts to skip")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model_dir = ensure_default_model(progress=None)
    skip = set(args.skip.split(","))
    report: dict[str, Any] = {}
    if "mask" not in skip:
        report |= mask_times(model_dir, [int(b) for b in args.batches.split(",")])
    if "gpu" not in skip:
        for n in (int(x) for x in args.gpu_n.split(",")):
            for constrained in (False, True):
                key = f"gpu_busy_{args.step_ms:g}ms_n{n}_{'json' if constrained else 'free'}"
                busy, wait = gpu_busy(model_dir, n, args.step_ms, args.gpu_steps, constrained)
                report[key] = round(busy, 3)
                if constrained:
                    report[f"mask_wait_ms_per_step_n{n}"] = round(wait * 1e3, 3)
    if "throughput" not in skip:
        report |= throughput(model_dir, args.n, args.max_tokens, args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:>40}: {value}")
    return report


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    main()

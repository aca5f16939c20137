"""End-to-end run of an engine on the GPU: decode tokens/s, the device-busy fraction, greedy
agreement with the CPU engine (issue 15, item 5; run by tools/gpu_check.sh).

For each batch size B (default 1, 64, 256): B requests of a 32-token prompt, greedy, ignore_eos,
`--new-tokens` each (default 256), stepped to the end after a warm-up batch (graph capture and
kernel compilation are not timed). Reports decode tokens/s (B x new tokens / wall) and the
device-busy fraction: the device time between a CUDA event recorded before each step and one after
its sampled ids are read back, summed over the steps, over the wall time; with async scheduling
on and off when the engine has that switch. Then the first `--greedy-tokens` (32) greedy tokens
of the held prompts, GPU engine (fp16) vs CPU engine (fp32).

The model: `--model DIR` (the default model in $KVCORE_HOME, when that machine has it), else
random weights with the shape of `--like DIR`'s config.json and its tokenizer (the GPU machine is
offline and takes at most 64 MiB of files: the 93 MB default model cannot travel, its config and
tokenizer can; `bash tools/gpu_check.sh --fetch-wheels` copies them to gpu_model/). On random
weights near-ties are common, so the greedy check reports the agreement instead of failing.

    python tools/gpu_e2e.py [--model DIR | --like DIR] [--device cuda] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Count from 1 to 10."}],
    [{"role": "user", "content": "Give me three tips for sleeping well."}],
]
PROMPT_LEN = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a model directory with weights")
    src.add_argument("--like", help="a directory with config.json + tokenizer: random weights")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the results here too")
    return ap.parse_args(argv)


def random_model(like: Path, out: Path) -> Path:
    """config.json and tokenizer files of `like`, random weights of its shape (seed 0)."""
    from safetensors.numpy import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_model import tiny_weights  # the test suite's random-weight writer

    out.mkdir(parents=True, exist_ok=True)
    for f in like.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((like / "config.json").read_text())
    save_file(tiny_weights(cfg, seed=0), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


class StepTimer:
    """Device time of each step between two CUDA events, summed (None on the CPU)."""

    def __init__(self, device: str) -> None:
        self.cupy: Any = None
        if device == "cuda":
            import cupy  # type: ignore[import-not-found]

            self.cupy = cupy
        self.pairs: list[tuple[Any, Any]] = []

    def wrap(self, engine: Any) -> None:
        if self.cupy is None:
            return
        core, cupy, pairs = engine.core, self.cupy, self.pairs
        step = core.step

        def timed_step() -> Any:
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            out = step()
            end.record()
            pairs.append((start, end))
            return out
        core.step = timed_step

    def busy_seconds(self) -> float | None:
        if self.cupy is None:
            return None
        for _, end in self.pairs:
            end.synchronize()
        total = sum(self.cupy.cuda.get_elapsed_time(s, e) for s, e in self.pairs) / 1e3
        self.pairs.clear()
        return total


def make_engine(model_dir: Path, device: str, max_num_seqs: int, max_len: int,
                async_scheduling: bool | None) -> Any:
    from kvcore.config import EngineConfig, SchedulerConfig
    from kvcore.engine import Engine

    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    if async_scheduling is not None and "async_scheduling" in names:
        kwargs["async_scheduling"] = async_scheduling
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_len,
                            max_num_batched_tokens=max(2048, max_num_seqs * PROMPT_LEN))
    return Engine(EngineConfig(model=str(model_dir), device=device, scheduler=sched, **kwargs))


def run_batch(engine: Any, timer: StepTimer, batch: int, new_tokens: int, vocab: int,
              tag: str) -> dict[str, Any]:
    from kvcore.sampling import SamplingParams

    rng = np.random.default_rng(batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", rng.integers(3, vocab, PROMPT_LEN).tolist(),
                           params)
    timer.busy_seconds()  # drop the events of earlier steps
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    busy = timer.busy_seconds()
    return {"batch": batch, "steps": steps, "wall_s": round(wall, 3),
            "tokens_per_s": round(batch * new_tokens / wall, 1),
            "busy": None if busy is None else round(busy / wall, 3)}


def greedy(engine: Any, prompts: list[list[int]], num: int) -> list[list[int]]:
    from kvcore.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"greedy-{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():  # each output carries the tokens new since the last
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    return [out[f"greedy-{i}"] for i in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        real = args.model is not None
        model_dir = Path(args.model) if real else random_model(Path(args.like), Path(tmp) / "m")
        results: dict[str, Any] = {"model": str(args.model or args.like), "real_weights": real,
                                   "device": args.device, "runs": []}
        max_len = PROMPT_LEN + args.new_tokens + 8
        for mode in (True, False):
            engine = make_engine(model_dir, args.device, max(batches), max_len, mode)
            vocab = engine.model_config.vocab_size
            timer = StepTimer(args.device)
            timer.wrap(engine)
            run_batch(engine, timer, min(8, max(batches)), 8, vocab, "warm")  # captures, JIT
            for b in batches:
                row = run_batch(engine, timer, b, args.new_tokens, vocab, "run")
                row["async_scheduling"] = mode
                results["runs"].append(row)
                print(f"gpu_e2e: batch {b:4d} async {mode!s:5}  {row['tokens_per_s']:9.1f} tok/s"
                      f"  busy {row['busy']}  ({row['steps']} steps, {row['wall_s']} s)",
                      flush=True)
            if "async_scheduling" not in {f.name for f in dataclasses.fields(
                    type(engine.config))}:
                break  # no switch: one mode only
            del engine
        from kvcore.model.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
        prompts = [tok.encode(tok.apply_chat_template(m)) for m in CHAT_PROMPTS] if real else [
            np.random.default_rng(7 + i).integers(3, vocab, 20).tolist() for i in range(4)]
        dev = greedy(make_engine(model_dir, args.device, 4, 1024, None), prompts,
                     args.greedy_tokens)
        cpu = greedy(make_engine(model_dir, "cpu", 4, 1024, None), prompts, args.greedy_tokens)
        agree = [next((i for i, (a, b) in enumerate(zip(d, c, strict=True)) if a != b), len(d))
                 for d, c in zip(dev, cpu, strict=True)]
        results["greedy_agreement"] = agree
        print(f"gpu_e2e: greedy tokens equal before the first difference, per prompt: {agree} "
              f"of {args.greedy_tokens} ({'real' if real else 'random'} weights)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    equal = all(a == args.greedy_tokens for a in agree)
    return 0 if equal or not real else 1


if __name__ == "__main__":
    sys.exit(main())

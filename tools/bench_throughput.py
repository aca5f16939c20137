"""Offline throughput in the shape of nano-vllm's bench, kvcore beside transformers, one run.

Requests: random token ids, input lengths uniform in [16, max_input], output lengths uniform in
[16, max_output], seeded, ignore_eos (every request generates exactly its output length).
kvcore: LLM.generate over all requests at once (continuous batching). transformers: `generate`
in static batches of 32, left-padded, each batch running to its longest output (EOS suppressed
with min_new_tokens); only the tokens each request asked for are counted.

    .venv/bin/python tools/bench_throughput.py                      # 256 requests (slow on CPU)
    .venv/bin/python tools/bench_throughput.py --num-requests 32 --max-input 256 --max-output 64
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

# isort: off
import kvcore  # noqa: F401  (before NumPy: sets OpenBLAS's thread timeout, see kvcore/__init__)
import numpy as np
import structlog
# isort: on


def make_requests(seed: int, num: int, vocab_size: int, max_input: int,
                  max_output: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab_size, size=int(n)).tolist()
               for n in rng.integers(16, max_input + 1, size=num)]
    outputs = [int(n) for n in rng.integers(16, max_output + 1, size=num)]
    return prompts, outputs


def bench_kvcore(model_dir: Path, prompts: list[list[int]], outputs: list[int],
                 device: str) -> tuple[float, int]:
    from kvcore.engine import LLM
    from kvcore.sampling import SamplingParams

    llm = LLM(str(model_dir), device=device)
    llm.generate([prompts[0]], SamplingParams(max_tokens=2))  # warm-up (rope tables, allocator)
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True, seed=i)
              for i, n in enumerate(outputs)]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert num_tokens == sum(outputs)
    stats = llm.engine.stats()
    print(f"  kvcore: {stats.num_blocks} blocks of {stats.block_size}, "
          f"{stats.num_preemptions} preemptions")
    return elapsed, num_tokens


def bench_transformers(model_dir: Path, prompts: list[list[int]], outputs: list[int],
                       batch_size: int) -> tuple[float, int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32).eval()
    pad = model.config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)  # (B, T) left-padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        new = max(outputs[first:first + batch_size])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=True, temperature=0.6, top_p=1.0, top_k=0,
                           pad_token_id=pad)
    elapsed = time.perf_counter() - start
    return elapsed, sum(outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the default "
                                                      "model)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="transformers' static batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from kvcore.config import ModelConfig
    from kvcore.model.hub import resolve_model

    model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    prompts, outputs = make_requests(args.seed, args.num_requests, vocab, args.max_input,
                                     args.max_output)
    print(f"{args.num_requests} requests, input 16-{args.max_input} "
          f"({sum(map(len, prompts))} tokens), output 16-{args.max_output} "
          f"({sum(outputs)} tokens), seed {args.seed}, model {model_dir.name}")
    t, n = bench_kvcore(model_dir, prompts, outputs, args.device)
    print(f"kvcore:       {n} output tokens in {t:.1f} s = {n / t:.1f} tokens/s")
    if not args.skip_transformers:
        t_hf, n_hf = bench_transformers(model_dir, prompts, outputs, args.batch_size)
        print(f"transformers: {n_hf} output tokens in {t_hf:.1f} s = {n_hf / t_hf:.1f} tokens/s "
              f"(static batches of {args.batch_size}, left-padded)")
        print(f"speed-up:     {(n / t) / (n_hf / t_hf):.2f}x")


if __name__ == "__main__":
    main()

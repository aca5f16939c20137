"""Block sharing: n = 4 parallel sampling against 4 independent requests (peak KV blocks in use),
and beam width 4 against transformers' beam search (tokens/s), on the default model.

    .venv/bin/python tools/bench_sharing.py [--prompt-len 200] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import structlog


def peak_blocks(model_dir: Path, prompt: list[int], n: int, max_tokens: int,
                independent: bool, prefix_caching: bool) -> tuple[int, int]:
    """(peak blocks referenced, generated tokens) for one prompt sampled n times."""
    from kvcore.engine import LLM
    from kvcore.sampling import SamplingParams

    llm = LLM(str(model_dir), device="cpu", enable_prefix_caching=prefix_caching)
    engine = llm.engine
    if independent:
        for i in range(n):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, seed=i,
                                                               ignore_eos=True))
    else:
        engine.add_request("r", prompt, SamplingParams(n=n, max_tokens=max_tokens, seed=0,
                                                       ignore_eos=True))
    peak = tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # each output carries the tokens new since the last
            tokens += sum(len(c.token_ids) for c in out.outputs)
        peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
    return peak, tokens


def beam_rates(model_dir: Path, prompts: list[list[int]], width: int,
               max_tokens: int) -> tuple[float, float, int, bool]:
    import torch
    import transformers

    from kvcore.engine import LLM
    from kvcore.sampling import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    llm = LLM(str(model_dir), device="cpu")
    start = time.perf_counter()
    ours = [llm.beam_search([p], params)[0] for p in prompts]  # one prompt at a time, as HF
    t_ours = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in ours)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                              dtype=torch.float32).eval()
    eos = list(llm.engine.eos_token_ids)
    start = time.perf_counter()
    same = True
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                 max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=eos[0], length_penalty=1.0, early_stopping=False)
        best = [t for t in seq[0, len(prompt):].tolist()]
        best = best[:len(out.outputs[0].token_ids)]
        same = same and best == out.outputs[0].token_ids
    t_hf = time.perf_counter() - start
    return num_tokens / t_ours, num_tokens / t_hf, num_tokens, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--beam-prompts", type=int, default=3)
    parser.add_argument("--beam-max-tokens", type=int, default=24)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from kvcore.model.hub import resolve_model
    from kvcore.model.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 49152, size=args.prompt_len).tolist()
    shared, _ = peak_blocks(model_dir, prompt, 4, args.max_tokens, False, True)
    cached, _ = peak_blocks(model_dir, prompt, 4, args.max_tokens, True, True)
    separate, _ = peak_blocks(model_dir, prompt, 4, args.max_tokens, True, False)
    print(f"n=4, prompt {args.prompt_len} tokens, {args.max_tokens} new tokens each, "
          f"blocks of 16; peak KV blocks in use:")
    print(f"  n=4 (one prefill, forked):                 {shared}")
    print(f"  4 independent requests, prefix cache on:   {cached}  "
          f"(n=4 saves {1 - shared / cached:.0%})")
    print(f"  4 independent requests, prefix cache off:  {separate}  "
          f"(n=4 saves {1 - shared / separate:.0%})")

    tok = Tokenizer.from_dir(model_dir)
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a haiku about the sea.", "Why is the sky blue?"][:args.beam_prompts]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in questions]
    ours, hf, num_tokens, same = beam_rates(model_dir, prompts, 4, args.beam_max_tokens)
    print(f"beam width 4, {len(prompts)} chat prompts, max {args.beam_max_tokens} tokens "
          f"({num_tokens} best-beam tokens), one prompt at a time:")
    print(f"  kvcore:       {ours:.2f} tokens/s")
    print(f"  transformers: {hf:.2f} tokens/s   (speed-up {ours / hf:.2f}x; "
          f"same best beams: {same})")


if __name__ == "__main__":
    main()

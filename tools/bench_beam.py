"""Beam search throughput: the engine's own (a driver over the core's forks, one step per beam
step, every beam's row in the batch) against vLLM V1's shape (a driver outside the engine that
adds one single-token request per live beam and step, each re-reading its prefix from the prefix
cache), on the default model; both score with the same BeamSearch, so their best beams must agree.

    .venv/bin/python tools/bench_beam.py [--json] [--width 4] [--max-tokens 24] [--prompts 4]
        [--only engine]

Reports best-beam tokens per second of each way (prompts one at a time, as a client would),
after one warm-up request.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

import numpy as np
import structlog

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea.",
             "Why is the sky blue?", "Count to five.", "What is a prime number?"]


def by_requests(llm: Any, prompt: list[int], width: int, max_tokens: int) -> list[int]:
    """vLLM V1's beam search: per step, one request of max_tokens 1 per live beam (its prompt
    the beam's whole prefix, served from the prefix cache), top 2W + 1 logprobs scored on the
    host. Returns the best beam's tokens."""
    from kvcore.sampling import BeamSearch, BeamSearchParams, SamplingParams

    eos = list(llm.engine.eos_token_ids)
    search = BeamSearch(BeamSearchParams(beam_width=width, max_tokens=max_tokens), eos)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=min(2 * width + 1, 20))
    while not search.done:
        outs = llm.generate([prompt + list(beam) for beam, _ in search.live], params)
        rows = np.full((len(outs), vocab), -np.inf, np.float32)  # (L, V) the top logprobs only
        for i, out in enumerate(outs):
            (lp,) = out.outputs[0].logprobs
            for token_id, value in ((lp.token_id, lp.logprob), *lp.top):
                rows[i, token_id] = value
        search.step(rows)
    return list(search.results()[0].token_ids)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--only", choices=("engine",), help="the engine's beam search only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kvcore.engine import LLM
    from kvcore.sampling import BeamSearchParams

    llm = LLM(device="cpu")
    tok = llm.engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in QUESTIONS[:args.prompts]]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens)
    llm.beam_search([prompts[0]], params)  # warm-up
    start = time.perf_counter()
    engine_best = [llm.beam_search([p], params)[0].outputs[0].token_ids for p in prompts]
    engine_s = time.perf_counter() - start
    num_tokens = sum(map(len, engine_best))
    report: dict[str, Any] = {"width": args.width, "max_tokens": args.max_tokens,
                              "prompts": len(prompts), "best_beam_tokens": num_tokens,
                              "engine_tokens_per_s": round(num_tokens / engine_s, 2)}
    if args.only is None:
        by_requests(llm, prompts[0], args.width, 2)  # warm-up
        start = time.perf_counter()
        request_best = [by_requests(llm, p, args.width, args.max_tokens) for p in prompts]
        requests_s = time.perf_counter() - start
        report["requests_tokens_per_s"] = round(num_tokens / requests_s, 2)
        report["same_best_beams"] = sum(a == b for a, b in zip(engine_best, request_best,
                                                                strict=True))
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return report


if __name__ == "__main__":
    main()

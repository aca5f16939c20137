"""`kvcore eval`: output quality of weight formats (and KV-cache dtypes) against a baseline.

Each variant ("none", "int8", "q4", "auto", optionally ":CACHE_DTYPE", e.g. "int8:fp16") is
scored on the same text: perplexity and top-1 agreement of next-token predictions with the
first variant (the baseline, fp32 by default); then the default chat prompts' greedy outputs
side by side. The text: --text FILE, or by default the documentation topics that ship with
Python itself (pydoc_data.topics, English prose and code), the first --tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvcore.cli import CLIError

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Write a Python function that adds two numbers."}],
    [{"role": "user", "content": "Count from 1 to 10."}],
    [{"role": "user", "content": "Give me three tips for sleeping well."}],
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="model directory (default: the default model)")
    parser.add_argument("--formats", default="none,int8,auto", metavar="LIST",
                        help="comma-separated variants, the first the baseline: none, int8, q4, "
                        "auto, each optionally :KV_CACHE_DTYPE (default none,int8,auto)")
    parser.add_argument("--tokens", type=int, default=20480, metavar="N",
                        help="tokens of the text to score (default 20480)")
    parser.add_argument("--text", metavar="FILE", help="a UTF-8 text to score (default: "
                        "Python's own documentation topics, pydoc_data.topics)")
    parser.add_argument("--window", type=int, default=1024, metavar="N",
                        help="tokens per independently scored window (default 1024)")
    parser.add_argument("--greedy-tokens", type=int, default=48, metavar="N",
                        help="greedy tokens per chat prompt (0: skip; default 48)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def default_text() -> tuple[str, str]:
    """(text, where it is from): Python's documentation topics, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)), "pydoc_data.topics"


def run(args: argparse.Namespace) -> int:
    from kvcore.model.quality import Variant

    variants = [Variant.parse(v.strip()) for v in args.formats.split(",") if v.strip()]
    if not variants:
        raise CLIError("--formats names no variant")
    for v in variants:
        if v.quantization not in ("none", "int8", "q4", "auto"):
            raise CLIError(f"--formats: unknown weight format {v.quantization!r}")
    if args.tokens < 2 or args.window < 2:
        raise CLIError("--tokens and --window must be at least 2")
    results = evaluate(args, variants)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def evaluate(args: argparse.Namespace, variants: list[Any]) -> dict[str, Any]:
    from kvcore.model.hub import resolve_model
    from kvcore.model.loader import load_model
    from kvcore.model.quality import score_text, text_digest
    from kvcore.model.quantized import model_weight_bytes, resolve_quantization
    from kvcore.model.tokenizer import Tokenizer

    try:
        model_dir = resolve_model(args.model)
    except ValueError as e:
        raise CLIError(str(e)) from e
    tokenizer = Tokenizer.from_dir(model_dir)
    text, source = (Path(args.text).read_text(), args.text) if args.text else default_text()
    token_ids = tokenizer.encode(text)[:args.tokens]
    if len(token_ids) < 2:
        raise CLIError(f"the text has {len(token_ids)} token(s); at least 2 are needed")
    rows: list[dict[str, Any]] = []
    baseline = None
    for variant in variants:
        weight_format = resolve_quantization(variant.quantization, model_dir, "cpu")
        start = time.perf_counter()
        model = load_model(model_dir, "cpu", weight_format=weight_format)
        score = score_text(model, token_ids, variant.cache_dtype, window=args.window)
        baseline = baseline or score
        rows.append({"variant": variant.label, "weights": weight_format,
                     "cache_dtype": variant.cache_dtype,
                     "weight_bytes": model_weight_bytes(model),
                     "perplexity": score.perplexity,
                     "perplexity_vs_baseline": score.perplexity / baseline.perplexity - 1,
                     "top1_agreement": score.agreement(baseline),
                     "seconds": time.perf_counter() - start,
                     "greedy": _greedy(model_dir, variant, tokenizer, args.greedy_tokens)})
        del model
    return {"model": str(model_dir), "text": source, "tokens": len(token_ids),
            "text_sha256_16": text_digest(token_ids), "window": args.window, "rows": rows}


def _greedy(model_dir: Path, variant: Any, tokenizer: Any, max_tokens: int) -> list[str]:
    """The chat prompts' greedy completions through the engine, with this variant."""
    if max_tokens <= 0:
        return []
    from kvcore.engine.llm import LLM
    from kvcore.sampling import SamplingParams

    llm = LLM(str(model_dir), device="cpu", quantization=variant.quantization,
              cache_dtype=variant.cache_dtype)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(m)) for m in CHAT_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [out.outputs[0].text for out in outputs]


def format_table(results: dict[str, Any]) -> str:
    lines = [f"model {results['model']}; text {results['text']} ({results['tokens']} tokens, "
             f"sha256 {results['text_sha256_16']}), windows of {results['window']}",
             f"{'variant':<14}{'weights':<8}{'weight MB':>10}{'perplexity':>12}{'vs base':>9}"
             f"{'top-1 agree':>13}"]
    for row in results["rows"]:
        lines.append(f"{row['variant']:<14}{row['weights']:<8}{row['weight_bytes'] / 1e6:>10.1f}"
                     f"{row['perplexity']:>12.4f}{row['perplexity_vs_baseline']:>+8.2%}"
                     f"{row['top1_agreement']:>13.2%}")
    for i in range(max((len(r["greedy"]) for r in results["rows"]), default=0)):
        lines.append(f"\nchat prompt {i + 1}:")
        for row in results["rows"]:
            lines.append(f"  [{row['variant']}] {row['greedy'][i]!r}")
    return "\n".join(lines)

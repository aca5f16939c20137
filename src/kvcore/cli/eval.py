"""`kvcore eval`: output quality of KV-cache dtypes (and weight formats) against a baseline.

Each variant (a KV-cache dtype of --kv-dtypes, default fp32 fp16 bf16 fp8 int4, with fp32 weights
so that the cache's own error is measured; or --formats' "none", "int8", "q4", "auto", each
optionally ":KV_DTYPE") is scored on the same text against the first (the baseline, the fp32
cache by default): perplexity, mean KL divergence of the next-token distributions, top-1
agreement, then the chat prompts' greedy outputs (agreement before the first difference, and the
texts side by side). The text: --text FILE, or by default the documentation topics that ship
with Python itself (pydoc_data.topics, English prose and code), the first --tokens tokens, in
windows of --context tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvcore.cache import int4
from kvcore.cli import CLIError
from kvcore.config import CacheConfig

INT4_WINDOW = CacheConfig().int4_window_tokens  # the engine's default, so eval measures it
DEFAULT_KV_DTYPES = "fp32,fp16,bf16,fp8,int4"
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
    parser.add_argument("--kv-dtypes", metavar="LIST",
                        help="comma-separated KV cache dtypes, the first the baseline: fp32, fp16, "
                        "bf16, fp8, int4 (int4-gGROUP-rWINDOW sets its group and window); default "
                        f"{DEFAULT_KV_DTYPES} unless --formats names KV dtypes")
    parser.add_argument("--formats", metavar="LIST",
                        help="comma-separated weight formats, the first the baseline: none, int8, "
                        "q4, auto, each optionally :KV_DTYPE (default none: fp32 weights, whose "
                        "results move only with the cache; quantized weights round activations, "
                        "which turns the cache's small errors into flips of near ties)")
    parser.add_argument("--tokens", type=int, default=2048, metavar="N",
                        help="tokens of the text to score (default 2048: one window)")
    parser.add_argument("--text", metavar="FILE", help="a UTF-8 text to score (default: "
                        "Python's own documentation topics, pydoc_data.topics)")
    parser.add_argument("--context", "--window", dest="context", type=int, default=2048,
                        metavar="N", help="tokens per independently scored window: the context "
                        "the cache's error accumulates over (default 2048)")
    parser.add_argument("--chunk", type=int, default=256, metavar="N",
                        help="tokens per forward step within a window (default 256; an int4 "
                        "cache is fed one block per step, so its window works as in decode)")
    parser.add_argument("--greedy-tokens", type=int, default=64, metavar="N",
                        help="greedy tokens per chat prompt (0: skip; default 64)")
    parser.add_argument("--int4-group", type=int, default=int4.DEFAULT_GROUP, metavar="G",
                        help=f"int4 value channels per scale (default {int4.DEFAULT_GROUP})")
    parser.add_argument("--int4-window", type=int, default=INT4_WINDOW, metavar="R",
                        help=f"an int4 cache's fp16 window in tokens, rounded up to whole blocks "
                             f"(default {INT4_WINDOW})")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars on stderr")


def default_text() -> tuple[str, str]:
    """(text, where it is from): Python's documentation topics, in sorted key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics)), "pydoc_data.topics"


def variants_of(args: argparse.Namespace) -> list[Any]:
    """The variants the flags ask for; CLIError naming the flag otherwise."""
    from kvcore.model.quality import Variant, replace_kv

    def split(text: str, param: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise CLIError(f"{param} names no variant: {text!r}")
        return items

    try:
        formats = [Variant.parse(f) for f in split(args.formats or "none", "--formats")]
        if args.kv_dtypes is None and args.formats is not None:
            return formats
        if args.kv_dtypes is not None and args.formats is not None and ":" in args.formats:
            raise CLIError("--formats: name the KV dtypes in --formats or in --kv-dtypes, "
                           f"not both (got {args.formats!r})")
        kv_dtypes = split(args.kv_dtypes or DEFAULT_KV_DTYPES, "--kv-dtypes")
        return [replace_kv(f, kv) for f in formats for kv in kv_dtypes]
    except ValueError as e:
        raise CLIError(str(e)) from e


def check_args(args: argparse.Namespace) -> None:
    for name, value, least in (("--tokens", args.tokens, 2), ("--context", args.context, 2),
                               ("--chunk", args.chunk, 1), ("--greedy-tokens", args.greedy_tokens,
                                                            0),
                               ("--int4-group", args.int4_group, 1),
                               ("--int4-window", args.int4_window, 0)):
        if value < least:
            raise CLIError(f"{name} must be at least {least}, got {value}")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    variants = variants_of(args)
    results = evaluate(args, variants)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def evaluate(args: argparse.Namespace, variants: list[Any]) -> dict[str, Any]:
    from kvcore.model.hub import resolve_model
    from kvcore.model.loader import load_model
    from kvcore.model.quality import greedy_agreement, text_digest
    from kvcore.model.quality_runs import BLOCK_SIZE, CachedModel, greedy, score_text
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
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(m, add_generation_prompt=True))
               for m in CHAT_PROMPTS]
    greedy_blocks = len(prompts) * -(-(max(map(len, prompts)) + args.greedy_tokens) // BLOCK_SIZE)
    num_blocks = max(-(-args.context // BLOCK_SIZE), greedy_blocks)
    models: dict[str, Any] = {}
    runs = []
    for v in variants:
        weights = resolve_quantization(v.quantization, model_dir, "cpu")
        if weights not in models:
            models[weights] = load_model(model_dir, "cpu", weight_format=weights)
        group = args.int4_group if v.int4_group is None else v.int4_group
        window = args.int4_window if v.int4_window is None else v.int4_window
        if v.cache_dtype == "int4":
            try:
                int4.check_layout(BLOCK_SIZE, models[weights].config.kv_layout[1], group)
            except ValueError as e:
                raise CLIError(f"{'--int4-group' if v.int4_group is None else '--kv-dtypes'}: "
                               f"{e}") from e
        runs.append(CachedModel(models[weights], v, num_blocks, group, window))
    start = time.perf_counter()
    with tqdm(total=len(token_ids) - 1, desc="scoring", unit="tok", file=sys.stderr,
              disable=args.no_progress, dynamic_ncols=True) as bar:
        scores = score_text(runs, token_ids, args.context, args.chunk, bar.update)
    scoring_seconds = time.perf_counter() - start
    eos = list(runs[0].model.config.eos_token_ids)
    outputs = []
    for r in tqdm(runs, desc="greedy", unit="variant", file=sys.stderr,
                  disable=args.no_progress or args.greedy_tokens == 0, dynamic_ncols=True):
        outputs.append(greedy(r, prompts, args.greedy_tokens, eos))
    rows = []
    for r, score, out in zip(runs, scores, outputs, strict=True):
        v = r.variant
        rows.append({
            "variant": v.label, "weights": resolve_quantization(v.quantization, model_dir, "cpu"),
            "cache_dtype": v.cache_dtype,
            "int4": r.int4,
            "weight_bytes": model_weight_bytes(r.model),
            "perplexity": score.perplexity,
            "perplexity_vs_baseline": score.perplexity / scores[0].perplexity - 1,
            "mean_kl": score.mean_kl,
            "top1_agreement": score.agreement(scores[0]),
            "greedy_agreement": greedy_agreement(outputs[0], out),
            "greedy_identical": sum(a == b for a, b in zip(outputs[0], out, strict=True)),
            "greedy": [tokenizer.decode(ids) for ids in out]})
    return {"model": str(model_dir), "text": source, "tokens": len(token_ids),
            "text_sha256_16": text_digest(token_ids), "context": args.context,
            "chunk": args.chunk, "greedy_tokens": args.greedy_tokens,
            "greedy_prompts": len(prompts), "seconds": round(scoring_seconds, 1), "rows": rows}


def format_table(results: dict[str, Any]) -> str:
    lines = [f"model {results['model']}; text {results['text']} ({results['tokens']} tokens, "
             f"sha256 {results['text_sha256_16']}), windows of {results['context']} tokens fed "
             f"{results['chunk']} per step; greedy: {results['greedy_prompts']} chat prompts x "
             f"{results['greedy_tokens']} tokens",
             f"{'variant':<20}{'weights':<8}{'weight MB':>10}{'perplexity':>12}{'vs base':>9}"
             f"{'mean KL':>10}{'top-1 agree':>13}{'greedy agree':>14}"]
    for row in results["rows"]:
        lines.append(f"{row['variant']:<20}{row['weights']:<8}{row['weight_bytes'] / 1e6:>10.1f}"
                     f"{row['perplexity']:>12.4f}{row['perplexity_vs_baseline']:>+9.2%}"
                     f"{row['mean_kl']:>10.5f}{row['top1_agreement']:>13.2%}"
                     f"{row['greedy_agreement']:>14.2%}")
    for row in results["rows"]:
        if row["int4"]:
            lines.append(f"{row['variant']}: the int4 cache, values in groups of "
                         f"{row['int4']['group']}, a {row['int4']['window']}-token fp16 window "
                         "(a row's own super-block in fp16, earlier blocks sealed)")
    for i in range(max((len(r["greedy"]) for r in results["rows"]), default=0)):
        lines.append(f"\nchat prompt {i + 1}:")
        for row in results["rows"]:
            lines.append(f"  [{row['variant']}] {row['greedy'][i]!r}")
    return "\n".join(lines)

"""`kvcore generate [MODEL] PROMPT`: stream one completion to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys

import structlog

from kvcore.cli import CLIError
from kvcore.cli.tier_args import add_tier_arguments, tier_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="+", metavar="[MODEL] PROMPT",
                        help="an HF-style model directory (default: SmolLM2-135M-Instruct, "
                             "obtained on first use) and the prompt")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt as a user message in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 = greedy (default); above 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="nucleus sampling mass (default 1.0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where to run (default: cuda when available, else cpu)")
    parser.add_argument("--quantization", default="auto", choices=("auto", "none", "int8", "q4"),
                        help="weights in memory (CPU), as kvcore serve's (default auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="cuda: run every step eagerly (no CUDA graphs for decode steps)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=None, help="schedule the next step while the device runs this "
                        "one (default: on for cuda, off for cpu)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                        '"prompt_lookup_min": 2}\' or "method": "suffix"; outputs are '
                        'unchanged, only faster where drafts are accepted (default: off)')
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show the engine's log lines and a timing summary")
    # a disk tier keeps a long prompt's K/V for the next run (llama.cpp's --prompt-cache)
    add_tier_arguments(parser, host=False, policy=False)


def run(args: argparse.Namespace) -> int:
    if len(args.args) > 2:
        raise CLIError(f"expected [MODEL] PROMPT, got {len(args.args)} arguments "
                       "(quote a prompt with spaces)")
    model, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    saved = structlog.get_config()
    # stdout carries the completion only: engine log lines go to stderr, and only with -v
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(
                            logging.INFO if args.verbose else logging.WARNING))
    try:
        return _generate(args, model, prompt)
    finally:
        structlog.configure(**saved)


def _generate(args: argparse.Namespace, model: str | None, prompt: str) -> int:
    from kvcore.device import resolve_device
    from kvcore.engine import Engine
    from kvcore.engine.llm import engine_config
    from kvcore.model.hub import resolve_model
    from kvcore.request import merge_outputs
    from kvcore.sampling import SamplingParams

    try:
        resolve_device(args.device)  # --device cuda without a GPU: before the model is fetched
    except RuntimeError as e:
        raise CLIError(str(e)) from e
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed)
        model_dir = resolve_model(model)
        tiers = tier_config(args)
        engine = Engine(engine_config(str(model_dir), device=args.device, max_num_seqs=1,
                                      enforce_eager=args.enforce_eager,
                                      async_scheduling=args.async_scheduling,
                                      speculative_config=args.speculative_config,
                                      quantization=args.quantization,
                                      kv_tier_dir=tiers.kv_tier_dir,
                                      kv_tier_disk_size=tiers.kv_tier_disk_size))
        if args.chat:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        engine.add_request("cli", prompt, params)
    except (ValueError, OSError) as e:
        raise CLIError(str(e)) from e
    outputs = []
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs.append(out)
                sys.stdout.write(out.outputs[0].text if out.outputs else "")
                sys.stdout.flush()
    finally:
        engine.close()  # a disk tier's pages land before the process ends
    sys.stdout.write("\n")
    if args.verbose and outputs:
        out = merge_outputs(outputs)
        m = out.metrics
        choice = out.outputs[0]
        elapsed = (m.finished_time or 0.0) - (m.first_token_time or 0.0)
        rate = (len(choice.token_ids) - 1) / elapsed if elapsed > 0 else float("nan")
        print(f"[{len(out.prompt_token_ids)} prompt tokens, {len(choice.token_ids)} generated, "
              f"finish_reason={choice.finish_reason}, {rate:.1f} tokens/s after the first, "
              f"{out.num_cached_tokens} prompt tokens cached (restored from tiers: "
              f"{m.restored_tokens or {}})]", file=sys.stderr)
    return 0

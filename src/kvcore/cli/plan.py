"""`kvcore plan`: KV bytes per token and sequence, blocks and concurrent sequences in a budget."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvcore.cache.int4_window import num_window_slots
from kvcore.cli import CLIError
from kvcore.config import CacheConfig, ModelConfig, SchedulerConfig
from kvcore.config_tiers import OFFLOAD_DTYPES
from kvcore.planner import (
    DTYPE_BYTES,
    KV_DTYPES,
    PAGE_FILE_FIXED_BYTES,
    KVPlan,
    canonical_dtype,
    format_size,
    full_kv_bytes_per_token,
    page_bytes,
    parse_size,
    plan,
    tier_plan,
)

DEFAULT_CONTEXT = 4096
_CACHE, _SCHEDULER = CacheConfig(), SchedulerConfig()  # the engine's defaults


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The fields of a model config the planner needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    max_position_embeddings: int | None
    shared_kv: bool = False  # MLA: one "KV head" (latent + rope key) that is both K and V
    # MLA: (heads, qk_head_dim, v_head_dim) of the full per-head K/V it is compared with
    full_kv: tuple[int, int, int] | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR",
                        help="model directory with config.json (or the config.json file itself)")
    parser.add_argument("--layers", type=int, metavar="N", help="layers (without --model)")
    parser.add_argument("--kv-heads", type=int, metavar="N", help="KV heads (without --model)")
    parser.add_argument("--head-dim", type=int, metavar="N", help="head_dim (without --model)")
    # validated by the planner, not argparse choices, so a bad dtype is one line like other errors
    parser.add_argument("--dtype", default="fp16", metavar="{" + ",".join(KV_DTYPES) + "}",
                        help="KV cache element type (default fp16)")
    parser.add_argument("--kv-int4-window", type=int, default=_CACHE.int4_window_tokens,
                        metavar="TOKENS", help="int4: recent tokens kept in fp16 (default "
                        f"{_CACHE.int4_window_tokens}); the window pool is sized from it, "
                        "--max-num-seqs and --max-num-batched-tokens as `kvcore serve` sizes it")
    parser.add_argument("--max-num-seqs", type=int, default=_SCHEDULER.max_num_seqs,
                        metavar="N", help="int4: running sequences at most (default "
                        f"{_SCHEDULER.max_num_seqs})")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=_SCHEDULER.max_num_batched_tokens, metavar="N",
                        help="int4: tokens per step at most (default "
                        f"{_SCHEDULER.max_num_batched_tokens})")
    parser.add_argument("--context", type=int, metavar="TOKENS",
                        help=f"tokens per sequence (default: the model's max_position_embeddings "
                             f"with --model, else {DEFAULT_CONTEXT})")
    parser.add_argument("--memory", metavar="SIZE",
                        help="KV cache budget, e.g. 64GiB, 24GB, 512MiB or plain bytes")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS",
                        help="tokens per KV block (default 16)")
    parser.add_argument("--sliding-window", type=int, metavar="W",
                        help="attention window in tokens (overrides the model's)")
    parser.add_argument("--kv-offload-size", metavar="SIZE",
                        help="a host tier of this size: its capacity in tokens and sequences")
    parser.add_argument("--kv-offload-dtype", default="auto", choices=OFFLOAD_DTYPES,
                        help="the host tier's page format (default auto: the pool's bytes)")
    parser.add_argument("--kv-tier-disk-size", metavar="SIZE",
                        help="a disk tier of this size: its capacity in tokens and sequences")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    shape = _shape_from_args(args)
    context = args.context
    if context is None:
        context = shape.max_position_embeddings or DEFAULT_CONTEXT
    window = args.sliding_window if args.sliding_window is not None else shape.sliding_window
    try:
        dtype = canonical_dtype(args.dtype)
        memory = parse_size(args.memory) if args.memory is not None else None
        slots = (num_window_slots(args.max_num_seqs, args.kv_int4_window, args.block_size,
                                  args.max_num_batched_tokens) if dtype == "int4" else 0)
        result = plan(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype, context,
                      memory=memory, block_size=args.block_size, sliding_window=window,
                      shared_kv=shape.shared_kv, window_slots=slots)
    except ValueError as e:
        raise CLIError(_flag_names(str(e))) from e
    inputs: dict[str, Any] = {
        "model": args.model,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "dtype": dtype,
        "context": context,
        "memory": memory,
        "block_size": args.block_size,
        "sliding_window": window,
        "shared_kv": shape.shared_kv,
    }
    if dtype == "int4":
        inputs |= {"int4_window": args.kv_int4_window, "window_slots": slots,
                   "max_num_seqs": args.max_num_seqs}
    if shape.full_kv is not None:
        full = full_kv_bytes_per_token(shape.num_layers, *shape.full_kv, dtype)
        inputs["full_kv_bytes_per_token"] = full
        inputs["mla_ratio"] = round(full / result.bytes_per_token, 2)
    weights = _weight_bytes(Path(args.model)) if args.model is not None else None
    tiers = _tiers(args, shape, dtype, result)
    if args.json:
        print(json.dumps({**inputs, **asdict(result), "weight_bytes": weights, "tiers": tiers}))
    else:
        print(_human(inputs, result))
        for name, tier in tiers.items():
            print(f"{name + ' tier:':<18}{format_size(tier['capacity_bytes'])} holds "
                  f"{tier['pages']:,} pages of {format_size(tier['bytes_per_page'])} = "
                  f"{tier['tokens']:,} tokens, {tier['sequences']:,} sequences of "
                  f"{context:,} tokens")
        if weights:
            print("weights:          " + ", ".join(
                f"{fmt} {format_size(size)}" for fmt, size in weights.items()))
    return 0


def _tiers(args: argparse.Namespace, shape: ModelShape, dtype: str,
           result: KVPlan) -> dict[str, dict[str, Any]]:
    """Each tier's capacity (kvcore.cache.tiers' page sizes: a page is one block of every
    layer; a disk page adds its file's header)."""
    out: dict[str, dict[str, Any]] = {}
    sizes = {"host": args.kv_offload_size, "disk": args.kv_tier_disk_size}
    for name, size in sizes.items():
        if size is None:
            continue
        try:
            capacity = parse_size(size)
            page = page_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype,
                              args.block_size, shape.shared_kv,
                              args.kv_offload_dtype if name == "host" else "auto")
        except ValueError as e:
            raise CLIError(f"--{'kv-offload-size' if name == 'host' else 'kv-tier-disk-size'}"
                           f": {e}") from e
        if name == "disk":
            page += PAGE_FILE_FIXED_BYTES + 8 * args.block_size
        tier = tier_plan(capacity, page, args.block_size, result.tokens_per_sequence)
        out[name] = {"capacity_bytes": capacity, **asdict(tier)}
    return out


def _weight_bytes(path: Path) -> dict[str, int] | None:
    """Weight bytes per --quantization format, for a Llama-family model directory."""
    from kvcore.model.quantized import planned_weight_bytes

    if not path.is_dir():
        return None
    try:
        config = ModelConfig.from_dir(path)
    except ValueError:
        return None
    return None if config.mla is not None else planned_weight_bytes(config, path)


def _shape_from_args(args: argparse.Namespace) -> ModelShape:
    explicit = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [flag for flag, value in explicit.items() if value is not None]
    if args.model is not None:
        if given:
            raise CLIError(f"give --model or --layers/--kv-heads/--head-dim, not both "
                           f"(got --model and {', '.join(given)})")
        return read_model_shape(Path(args.model))
    missing = [flag for flag, value in explicit.items() if value is None]
    if missing:
        raise CLIError(f"give --model DIR, or all of --layers, --kv-heads and --head-dim "
                       f"(missing {', '.join(missing)})")
    return ModelShape(args.layers, args.kv_heads, args.head_dim, None, None)


def read_model_shape(path: Path) -> ModelShape:
    """The planner's fields from a model directory or a config.json file.

    ModelConfig reads it when kvcore can serve the model; any other config.json that carries the
    KV fields (another architecture, a trimmed sample) still plans.
    """
    config_path = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CLIError(f"cannot read model config {config_path}: {e}") from e
    if not isinstance(raw, dict):
        raise CLIError(f"model config {config_path} is not a JSON object")
    try:
        mc = ModelConfig.from_dir(path) if path.is_dir() else ModelConfig.from_dict(raw)
    except ValueError:  # ConfigError (unsupported architecture, missing MLP fields) or bad JSON
        return _shape_from_fields(raw, config_path)
    heads, width, shared = mc.kv_layout
    full = (mc.num_heads, mc.mla.qk_head_dim, mc.mla.v_head_dim) if mc.mla else None
    return ModelShape(mc.num_layers, heads, width, mc.sliding_window,
                      mc.max_position_embeddings, shared, full)


def _shape_from_fields(raw: dict[str, Any], config_path: Path) -> ModelShape:
    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise CLIError(f"model config {config_path} is missing the field {key!r}")
        return raw[key]

    layers = need("num_hidden_layers")
    if raw.get("kv_lora_rank") is not None:  # MLA (DeepSeek): the latent and the rope key part
        latent, rope = need("kv_lora_rank"), need("qk_rope_head_dim")
        full = (need("num_attention_heads"), need("qk_nope_head_dim") + rope, need("v_head_dim"))
        return ModelShape(layers, 1, latent + rope, None, raw.get("max_position_embeddings"),
                          True, full)
    kv_heads = raw.get("num_key_value_heads") or need("num_attention_heads")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        heads, hidden = need("num_attention_heads"), need("hidden_size")
        if not isinstance(heads, int) or not isinstance(hidden, int) or heads <= 0:
            raise CLIError(f"model config {config_path}: cannot derive head_dim from hidden_size "
                           f"{hidden!r} and num_attention_heads {heads!r}")
        head_dim = hidden // heads
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") is False:
        window = None  # e.g. Qwen2 configs carry a window they do not use
    return ModelShape(layers, kv_heads, head_dim, window, raw.get("max_position_embeddings"))


def _flag_names(message: str) -> str:
    """Planner errors name parameters; the user typed flags."""
    for param, flag in (("num_layers", "--layers"), ("num_kv_heads", "--kv-heads"),
                        ("head_dim", "--head-dim"), ("block_size", "--block-size"),
                        ("sliding_window", "--sliding-window"), ("context", "--context"),
                        ("memory", "--memory"), ("dtype", "--dtype")):
        if message.startswith(param + " "):
            return flag + message[len(param):]
    if message.startswith("invalid size"):
        return "--memory: " + message
    return message


def _human(inputs: dict[str, Any], result: KVPlan) -> str:
    dtype = inputs["dtype"]
    window = inputs["sliding_window"]
    element = ("4 bits per element + fp16 scales and zeros" if dtype == "int4"
               else f"{DTYPE_BYTES[dtype]} bytes per element")
    lines = []
    if inputs["model"] is not None:
        lines.append(f"model:            {inputs['model']}")
    if inputs["shared_kv"]:
        lines.append(f"shape:            {inputs['num_layers']} layers x one latent K/V of "
                     f"{inputs['head_dim']} (MLA: kv_lora_rank + qk_rope_head_dim), {dtype} "
                     f"({element})")
    else:
        lines.append(f"shape:            {inputs['num_layers']} layers x {inputs['num_kv_heads']} "
                     f"KV heads x head_dim {inputs['head_dim']}, {dtype} ({element})")
    lines.append(f"per token:        {format_size(result.bytes_per_token)} "
                 f"({result.bytes_per_token:,} bytes)")
    if "full_kv_bytes_per_token" in inputs:
        full = inputs["full_kv_bytes_per_token"]
        lines.append(f"full K/V would:   {format_size(full)} per token ({full:,} bytes, per-head K "
                     f"and V of every head): MLA caches {inputs['mla_ratio']}x less")
    lines += [
        f"per block:        {format_size(result.bytes_per_block)} ({inputs['block_size']} tokens)",
    ]
    if result.window_bytes:
        lines.append(f"fp16 window:      {format_size(result.window_bytes)} "
                     f"({inputs['window_slots']:,} blocks: the last {inputs['int4_window']} "
                     f"tokens of up to {inputs['max_num_seqs']} sequences, outside the pool)")
    held = f"{result.tokens_per_sequence:,} tokens held"
    if window is not None:
        held += f", sliding window {window:,}"
    lines.append(f"per sequence:     {format_size(result.bytes_per_sequence)} at "
                 f"{inputs['context']:,} tokens of context ({held}, "
                 f"{result.blocks_per_sequence:,} blocks)")
    if result.num_blocks is not None:
        memory = inputs["memory"]
        lines += [
            f"memory:           {format_size(memory)} ({memory:,} bytes)",
            f"blocks:           {result.num_blocks:,}",
            f"max concurrent:   {result.max_concurrent_sequences:,} sequences of "
            f"{inputs['context']:,} tokens",
        ]
    return "\n".join(lines)

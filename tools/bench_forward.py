"""Forward-pass speed on the CPU: kvcore vs transformers (fp32, same threads), one run.

Prefill tokens/s for single prompts, decode step time for batches at a realistic context, and
the fraction of NumPy's own matmul rate (MLP shapes, batch 64) that the batch-64 decode step
reaches (Llama-family models). For an MLA model (DeepSeek) `--mla-modes` times each form of
its attention side by side (absorbed, decompressed, auto). `--breakdown` adds where the
batch-64 step's time goes, kernel by kernel, and what that leaves attention for 60% of the
matmul rate (when 64 is among --batches), and attention's share of a step at each batch size,
NumPy vs compiled kernel, beside its memory bound. `--record` writes the results into
docs/benchmarks.md, section `## Forward pass (CPU)` (MLA models: `## MLA forward (CPU)`).

    .venv/bin/python tools/bench_forward.py [--model DIR] [--threads N] [--breakdown] [--record]
        [--mla-modes absorbed,decompressed,auto]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

SECTION = "## Forward pass (CPU)"
SECTION_MLA = "## MLA forward (CPU)"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF-style model directory (default: the default model)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="BLAS threads for NumPy and torch alike (default: all cores)")
    p.add_argument("--prompts", default="32,512,2048", help="prefill prompt lengths")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--context", type=int, default=128, help="decode context length per sequence")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    p.add_argument("--no-transformers", action="store_true", help="skip the baseline")
    p.add_argument("--mla-modes", default="auto",
                   help="MLA models: attention forms to time side by side, of absorbed, "
                        "decompressed, auto (default auto)")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "q4", "auto"),
                   help="weights in memory (kvcore --quantization; default none: fp32)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each kernel of the batch-64 decode step, and attention's "
                   "share of every batch's step")
    p.add_argument("--record", action="store_true", help="write docs/benchmarks.md's section")
    p.add_argument("--kv-cache-dtype", default="fp32", choices=("fp32", "fp16", "bf16", "fp8"),
                   help="kvcore's KV cache dtype (default fp32, transformers' own)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: process CPU time, which other processes' load does not inflate "
                        "(meaningful with --threads 1 only)")
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1 (CPU time adds up every thread's)")
    return args


ARGS = parse_args()
CLOCK = time.process_time if ARGS.clock == "cpu" else time.perf_counter
# BLAS reads its thread count when first loaded: set it before NumPy or torch is imported
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
os.environ["KVCORE_NUM_THREADS"] = str(ARGS.threads)  # kvcore's own kernel threads too

import kvcore  # noqa: E402, F401, I001  (before NumPy: sets OpenBLAS's thread timeout)
import numpy as np  # noqa: E402

from kvcore.cache.kv_cache import KVCache  # noqa: E402
from kvcore.model import BatchInput, DeepseekModel, LlamaModel, load_model  # noqa: E402

BLOCK_SIZE = 16


def median_times(fns: list[Callable[[], object] | None], repeats: int,
                 setups: list[Callable[[], object] | None] | None = None) -> list[float | None]:
    """Median wall time of each fn over `repeats` runs after one warm-up each. The fns take
    turns run by run, so a load that drifts during the benchmark hits all of them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(repeats + 1):
        for j, fn in enumerate(fns):
            if fn is None:
                continue
            if setups and setups[j] is not None:
                setups[j]()  # type: ignore[misc]
            t = CLOCK()
            fn()
            if i:
                times[j].append(CLOCK() - t)
    return [statistics.median(t) if t else None for t in times]


def empty_cache(model: LlamaModel, num_blocks: int) -> KVCache:
    """The model's cache layout (MLA: one latent K/V array per layer)."""
    kv_heads, width, shared = model.config.kv_layout
    return KVCache(model.config.num_layers, num_blocks, BLOCK_SIZE, kv_heads, width,
                   ARGS.kv_cache_dtype, shared_kv=shared)


def fresh_cache(model: LlamaModel, num_blocks: int, rng: np.random.Generator) -> KVCache:
    cache = empty_cache(model, num_blocks)
    for array in {id(a): a for a in cache.key_caches + cache.value_caches}.values():
        # context content: random, not zeros
        array[...] = rng.standard_normal(array.shape, dtype=np.float32).astype(array.dtype)
    return cache


def in_mode(model: LlamaModel, mode: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """fn run with an MLA model's attention in `mode` (None: as it is)."""
    if mode is None:
        return fn

    def run() -> object:
        assert isinstance(model, DeepseekModel)
        model.mla_mode = mode
        return fn()
    return run


def ours_prefill(model: LlamaModel, length: int, rng: np.random.Generator) -> Callable[[], object]:
    num_blocks = -(-length // BLOCK_SIZE)
    cache = empty_cache(model, num_blocks)
    ids = [int(t) for t in rng.integers(0, model.config.vocab_size, length)]
    table = [int(b) for b in rng.permutation(num_blocks)]
    return lambda: model.forward(BatchInput.build([ids], [0], [table], BLOCK_SIZE), cache)


def ours_decode(model: LlamaModel, batch: int, context: int,
                rng: np.random.Generator) -> Callable[[], object]:
    return decode_step(model, batch, context, rng)[0]


def decode_step(model: LlamaModel, batch: int, context: int,
                rng: np.random.Generator) -> tuple[Callable[[], object], KVCache]:
    """(one decode step of `batch` sequences at `context`, the cache it reads: every block)."""
    per_seq = -(-context // BLOCK_SIZE)
    cache = fresh_cache(model, batch * per_seq, rng)
    perm = [int(b) for b in rng.permutation(batch * per_seq)]
    tables = [perm[s * per_seq:(s + 1) * per_seq] for s in range(batch)]
    tokens = [[int(t)] for t in rng.integers(0, model.config.vocab_size, batch)]
    # one decode step: the batch is rebuilt every step, as the engine does
    return lambda: model.forward(
        BatchInput.build(tokens, [context - 1] * batch, tables, BLOCK_SIZE), cache), cache


def kv_read(cache: KVCache) -> Callable[[], object]:
    """A read of every layer's K and V bytes in turn (what a step's attention must read when
    every block is in use), split over the kernel threads: the memory bound of the step's
    attention, on the same arrays."""
    from numba import njit, prange

    from kvcore.kernels.cpu.jit import compiled
    from kvcore.kernels.cpu.threads import num_threads

    @njit(parallel=True, cache=False)
    def read(words: np.ndarray) -> np.uint64:  # every 8 bytes once
        total = np.uint64(0)
        for i in prange(words.shape[0]):
            total += words[i]
        return total

    kernel = compiled()
    arrays = {id(a): a for a in cache.key_caches + cache.value_caches}.values()
    words = [a.reshape(-1).view(np.uint64) for a in arrays]
    read(words[0])

    def run() -> None:
        if kernel is not None:
            kernel.set_threads(num_threads())
        for w in words:
            read(w)
    return run


def matmul_rates(model: LlamaModel, batch: int, repeats: int) -> tuple[float, float]:
    """FLOP/s of NumPy's matmul on the MLP shapes with the model's own (out, in) weight arrays,
    the faster of x @ W.T and W @ x.T: one layer's gate_up/down again and again (cache-hot),
    and every layer's in turn (streamed from memory, as a decode step reads them)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, model.config.hidden_size), dtype=np.float32)
    y = rng.standard_normal((batch, model.config.intermediate_size), dtype=np.float32)
    hot = [model.layers[0]] * len(model.layers)

    def mlp(layers: list, weight_left: bool) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                if weight_left:
                    layer.gate_up @ x.T
                    layer.down @ y.T
                else:
                    x @ layer.gate_up.T
                    y @ layer.down.T
        return run

    flops = sum(2 * batch * (layer.gate_up.size + layer.down.size) for layer in model.layers)
    times = median_times([mlp(hot, False), mlp(hot, True), mlp(model.layers, False),
                          mlp(model.layers, True)], repeats)
    assert all(t is not None for t in times)
    return flops / min(times[:2]), flops / min(times[2:])  # type: ignore[type-var]


def decode_flops(model: LlamaModel, batch: int, context: int) -> float:
    """Matmul FLOPs of one decode step: weights (all layers + LM head) and attention."""
    c = model.config
    weights = sum(w.size for layer in model.layers
                  for w in (layer.qkv, layer.o, layer.gate_up, layer.down)) + model.lm_head.size
    attention = 4 * c.num_layers * context * c.num_heads * c.head_dim
    return float(batch * (2 * weights + attention))


# the step's kernels as LlamaModel.run calls them (module attributes, so a wrapper sees each call)
BREAKDOWN = (("weight GEMMs", "kvcore.model.llama", "_linear"),
             ("paged attention", "kvcore.kernels", "paged_attention"),
             ("reshape_and_cache", "kvcore.kernels", "reshape_and_cache"),
             ("rms_norm", "kvcore.kernels", "rms_norm"),
             ("rope", "kvcore.kernels", "rope"),
             ("silu_and_mul", "kvcore.kernels", "silu_and_mul"))


def step_breakdown(step: Callable[[], object], repeats: int) -> tuple[float, dict[str, float]]:
    """Mean time (CLOCK) of `step` and of each BREAKDOWN kernel within it, over `repeats` runs
    after a warm-up: every call of a kernel is timed around (attention's own threads included,
    as the caller waits for them); "other" is the rest (embedding, batch arrays, residual adds)."""
    spent = {label: 0.0 for label, _, _ in BREAKDOWN}
    originals = []
    for label, module_name, name in BREAKDOWN:
        module = importlib.import_module(module_name)
        original = getattr(module, name)
        originals.append((module, name, original))

        def timed(*args: object, _f: Callable[..., object] = original, _label: str = label,
                  **kwargs: object) -> object:
            t = CLOCK()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_label] += CLOCK() - t
        setattr(module, name, timed)
    try:
        step()
        spent.update({label: 0.0 for label in spent})
        t = CLOCK()
        for _ in range(repeats):
            step()
        total = (CLOCK() - t) / repeats
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
    parts = {label: v / repeats for label, v in spent.items()}
    parts["other"] = total - sum(parts.values())
    return total, parts


class Transformers:
    """The baseline: transformers' own forward on the same checkpoint, fp32, sdpa attention."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self.config = self.model.config

    def prefill(self, length: int, rng: np.random.Generator) -> Callable[[], object]:
        ids = self.torch.from_numpy(rng.integers(0, self.config.vocab_size, (1, length)))

        def run() -> None:
            with self.torch.inference_mode():
                self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return run

    def decode(self, batch: int, context: int,
               rng: np.random.Generator) -> tuple[Callable[[], object], Callable[[], object]]:
        from transformers import DynamicCache

        torch, cfg = self.torch, self.config
        cache = DynamicCache(config=cfg)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shapes = [(batch, cfg.num_key_value_heads, context - 1, head_dim)] * 2
        if getattr(cfg, "kv_lora_rank", None):  # MLA: the latent and the rope key, one "head"
            shapes = [(batch, 1, context - 1, cfg.kv_lora_rank),
                      (batch, 1, context - 1, cfg.qk_rope_head_dim)]
        for layer in range(cfg.num_hidden_layers):
            cache.update(torch.randn(shapes[0]), torch.randn(shapes[1]), layer)
        ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (batch, 1)))
        mask = torch.ones((batch, context), dtype=torch.long)
        positions = torch.full((batch, 1), context - 1)

        def run() -> None:
            with torch.inference_mode():
                self.model(input_ids=ids, past_key_values=cache, attention_mask=mask,
                           position_ids=positions, use_cache=True, logits_to_keep=1)

        def trim() -> None:  # back to context - 1 cached tokens: every step sees `context`
            if cache.get_seq_length() >= context:
                cache.crop(context - 1 - cache.get_seq_length())
        return run, trim


def main() -> int:
    from kvcore.model.hub import default_model_dir

    model_dir = Path(ARGS.model) if ARGS.model else default_model_dir()
    if not (model_dir / "config.json").exists():
        print(f"no model at {model_dir}: run `kvcore pull` or pass --model DIR", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    from kvcore.model.quantized import resolve_quantization

    weight_format = resolve_quantization(ARGS.quantization, model_dir, "cpu")
    model = load_model(model_dir, "cpu", weight_format=weight_format)
    hf = None if ARGS.no_transformers else Transformers(model_dir, ARGS.threads)
    rows = []
    mla = isinstance(model, DeepseekModel)
    modes: list[str | None] = list(ARGS.mla_modes.split(",")) if mla else [None]
    print(f"model {model_dir.name}, {ARGS.threads} threads, repeats {ARGS.repeats}")
    for length in (int(x) for x in ARGS.prompts.split(",")):
        repeats = max(1, ARGS.repeats if length < 1024 else ARGS.repeats // 2)
        *ours_ts, base_t = median_times(
            [*(in_mode(model, m, ours_prefill(model, length, rng)) for m in modes),
             hf.prefill(length, rng) if hf else None], repeats)
        for mode, ours_t in zip(modes, ours_ts, strict=True):
            assert ours_t is not None
            ours, base = length / ours_t, (length / base_t if base_t else None)
            rows.append((_kind("prefill", mode), f"{length} tokens", f"{ours:,.0f} tok/s",
                         f"{base:,.0f} tok/s" if base else "-", base and ours / base))
            print(rows[-1], flush=True)
    decode_ms = {}
    for batch in (int(x) for x in ARGS.batches.split(",")):
        run, trim = hf.decode(batch, ARGS.context, rng) if hf else (None, None)
        *ours_ts, base_t = median_times(
            [*(in_mode(model, m, ours_decode(model, batch, ARGS.context, rng)) for m in modes),
             run], ARGS.repeats, [*([None] * len(modes)), trim])
        for mode, ours_t in zip(modes, ours_ts, strict=True):
            assert ours_t is not None
            if mode is None:
                decode_ms[batch] = ours_t
            rows.append((_kind("decode step", mode), f"batch {batch}, context {ARGS.context}",
                         f"{ours_t * 1e3:.1f} ms", f"{base_t * 1e3:.1f} ms" if base_t else "-",
                         base_t and base_t / ours_t))
            print(rows[-1], flush=True)
    lines = [f"Model `{model_dir.name}` ({model.config.num_layers} layers, hidden "
             f"{model.config.hidden_size}), {weight_format} weights, "
             f"{ARGS.kv_cache_dtype} KV cache, "
             f"block size {BLOCK_SIZE}, "
             f"{ARGS.threads} BLAS threads for both, {platform.processor() or platform.machine()}, "
             f"NumPy {np.__version__}" + (f", {hf.version}" if hf else "") + ". Median of "
             f"{ARGS.repeats} timed runs after a warm-up, taking turns; "
             f"{'process CPU time' if ARGS.clock == 'cpu' else 'wall time'}; load average "
             f"{os.getloadavg()[0]:.1f} at the end." + _mla_note(model), "",
             "| measurement | shape | kvcore | transformers | kvcore speed-up |",
             "|---|---|---|---|---|"]
    for kind, shape, ours_s, base_s, ratio in rows:
        lines.append(f"| {kind} | {shape} | {ours_s} | {base_s} | "
                     f"{f'{ratio:.2f}x' if ratio else '-'} |")
    if 64 in decode_ms and isinstance(model.layers[0].gate_up, np.ndarray):  # float weights
        hot, streamed = matmul_rates(model, 64, ARGS.repeats)
        achieved = decode_flops(model, 64, ARGS.context) / decode_ms[64]
        lines += ["", f"Batch-64 decode step: {achieved / 1e9:.1f} GFLOP/s of matmul work "
                  f"(weights + attention). NumPy's own matmul at the MLP shapes (64 x "
                  f"{model.config.hidden_size} @ W_gate_up, 64 x "
                  f"{model.config.intermediate_size} @ W_down, the model's arrays, the faster of "
                  f"x @ W.T and W @ x.T): "
                  f"{hot / 1e9:.1f} GFLOP/s with one layer's weights cache-hot -> the step "
                  f"reaches **{achieved / hot:.0%}**; {streamed / 1e9:.1f} GFLOP/s with every "
                  f"layer's in turn (streamed from memory, as the step reads them) -> "
                  f"**{achieved / streamed:.0%}**."]
        if ARGS.breakdown:
            lines += breakdown_lines(model, streamed)
    if ARGS.breakdown:
        lines += attention_share_lines(model)
    given = [a for a in sys.argv[1:] if a != "--record"]  # as run, every option it was given
    if not any(a.startswith("--threads") for a in given):
        given.insert(0, f"--threads {ARGS.threads}")
    lines += ["", f"Command: `.venv/bin/python tools/bench_forward.py {' '.join(given)}`"]
    text = "\n".join(lines)
    print(text)
    if ARGS.record:
        record(text, SECTION_MLA if mla else SECTION)
    return 0


def _mla_note(model: LlamaModel) -> str:
    mla = model.config.mla
    if mla is None:
        return ""
    return (f" MLA: {model.config.num_heads} heads, latent {mla.kv_lora_rank} + rope "
            f"{mla.qk_rope_head_dim} cached per token, q/k nope {mla.qk_nope_head_dim}, v "
            f"{mla.v_head_dim}; `MLA auto` picks the form per sequence by multiply-adds.")


def _kind(kind: str, mode: str | None) -> str:
    return kind if mode is None else f"{kind}, MLA {mode}"


def breakdown_lines(model: LlamaModel, streamed: float) -> list[str]:
    """Where a batch-64 step goes (its own runs, on the run's clock), and the attention time
    that 60% of the streamed matmul rate would leave once everything else is counted."""
    total, parts = step_breakdown(ours_decode(model, 64, ARGS.context, np.random.default_rng(2)),
                                  ARGS.repeats)
    clock = "process CPU time" if ARGS.clock == "cpu" else "wall time"
    lines = ["", f"Where a batch-64 decode step goes ({ARGS.repeats} more runs, {clock}, "
             f"{total * 1e3:.1f} ms per step with a timer around every kernel call):", "",
             "| part | ms per step | share |", "|---|---|---|"]
    for label, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {label} | {seconds * 1e3:.1f} | {seconds / total:.0%} |")
    budget = decode_flops(model, 64, ARGS.context) / (0.6 * streamed)
    rest = total - parts["paged attention"]
    lines += ["", f"60% of the streamed rate means a step of at most {budget * 1e3:.1f} ms; "
              f"everything but attention takes {rest * 1e3:.1f} ms of this one, which leaves "
              f"attention **{max(budget - rest, 0.0) * 1e3:.1f} ms** (it took "
              f"{parts['paged attention'] * 1e3:.1f} ms)."]
    return lines


def attention_share_lines(model: LlamaModel) -> list[str]:
    """Attention's share of a decode step at each --batches size, with the NumPy kernel and
    with the compiled one, runs taking turns (the same steps, the same clock); beside them
    attention's memory bound (a read of the step's K/V bytes, timed in the same turns) and the
    share attention would have at that bound (the step's other work unchanged)."""
    from kvcore.kernels.cpu import jit

    lines = ["", f"Paged attention's share of a decode step at context {ARGS.context}, "
             f"{ARGS.kv_cache_dtype} cache, NumPy kernel vs compiled (numba) kernel "
             f"({ARGS.repeats} runs each, taking turns); memory bound: a read of the step's "
             "K/V bytes over the same threads, and the share attention would have at it:", "",
             "| batch | kernel | step | attention | attention share | step speed-up | "
             "K/V bytes | memory bound | share at the bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for batch in (int(x) for x in ARGS.batches.split(",")):
        step, cache = decode_step(model, batch, ARGS.context, np.random.default_rng(batch))
        read = kv_read(cache)
        nbytes = sum(a.nbytes for a in {id(a): a for a in cache.key_caches
                                        + cache.value_caches}.values())
        results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        reads = []
        for _ in range(ARGS.repeats):
            for compiled in (False, True):
                jit.set_enabled(compiled)
                total, parts = step_breakdown(step, 1)
                results[compiled].append((total, parts["paged attention"]))
            t = CLOCK()
            read()
            reads.append(CLOCK() - t)
        jit.set_enabled(True)
        bound = statistics.median(reads)
        totals = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
        for compiled in (False, True):
            attn = statistics.median(a for _, a in results[compiled])
            rest = totals[compiled] - attn
            lines.append(f"| {batch} | {'numba' if compiled else 'NumPy'} | "
                         f"{totals[compiled] * 1e3:.1f} ms | {attn * 1e3:.1f} ms | "
                         f"{attn / totals[compiled]:.0%} | "
                         f"{totals[False] / totals[compiled]:.2f}x | {nbytes / 2**20:.0f} MiB | "
                         f"{bound * 1e3:.1f} ms ({nbytes / bound / 1e9:.0f} GB/s) | "
                         f"{bound / (rest + bound):.0%} |")
    return lines


def record(body: str, section_name: str) -> None:
    """Write this run as one `### ` subsection (per thread count and clock) of this tool's own
    `## ` section of docs/benchmarks.md, leaving every other section and run as it is."""
    path = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    label = f"### {ARGS.threads} thread{'s' if ARGS.threads > 1 else ''}, {ARGS.clock} time"
    if section_name in old:
        start = old.index(section_name)
        end = old.find("\n## ", start + len(section_name))
        end = len(old) if end < 0 else end + 1
        section = old[start:end]
    else:
        start = end = len(old)
        section = f"{section_name}\n\nWritten by `tools/bench_forward.py --record`.\n"
        old = old.rstrip("\n") + "\n\n"
    runs = section.split("\n### ")
    head, kept = runs[0].rstrip("\n"), [r for r in runs[1:] if not label.endswith(r.split("\n")[0])]
    section = "\n\n".join([head, *("### " + r.rstrip("\n") for r in kept),
                            f"{label}\n\n{body}"]) + "\n"
    path.write_text(old[:start] + section + ("\n" + old[end:] if old[end:] else ""))


if __name__ == "__main__":
    sys.exit(main())

"""The NumPy reference sampler (tests/sampling_oracle.py) vs the xp sampler under NumPy, side by
side in one run: µs per row.

Batch 1 / 32 / 256 over the default model's vocabulary (49,152). Modes: greedy (temperature 0),
top_p (temperature 0.8 + top_p 0.95) and temperature (0.8 alone: the xp sampler then draws Gumbel
noise over the whole vocabulary). The logits are LM-shaped, not white noise: a Zipf law
(logit = -1.5 log rank, so top_p 0.95 keeps ~100 tokens, as real next-token distributions do)
over a random permutation of the vocabulary, plus N(0, 0.5) jitter; or, with --model-logits, the
default model's (or MODEL_DIR's) next-token logits after six prompts, cycled over the batch. Each
timed call gets a fresh
copy of the logits (both samplers process them in place); the copy is not timed. The xp time
includes building its SamplingBatch from the same SamplingRow list today's sampler takes. Calls
alternate between the two samplers; the median of --repeats is reported, in process CPU time by
default (--clock cpu: on a shared machine wall time includes the waits for a core; the samplers
run on one thread).

Validated before timing: greedy tokens equal; a sampled token is always one today's processors
keep (finite after temperature/top_p).

    flock /tmp/kvcore-bench.lock .venv/bin/python tools/bench_sampler.py [--repeats 7]
        [--model-logits [MODEL_DIR]]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvcore.sampling import SamplingParams, SamplingRow, XpSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sampling_oracle import Sampler, make_generator, process_logits  # noqa: E402

EOS = (2,)
MODES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=None),
    "top_p": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=None),
    "temperature": SamplingParams(temperature=0.8, max_tokens=None),
}


def lm_logits(batch: int, vocab: int, seed: int) -> np.ndarray:
    """(batch, vocab) float32: Zipf over a random permutation of the vocabulary, plus jitter."""
    rng = np.random.default_rng(seed)
    zipf = -1.5 * np.log(np.arange(1, vocab + 1, dtype=np.float64))  # (V,) by rank
    out = np.empty((batch, vocab), dtype=np.float32)  # (B, V)
    for i in range(batch):
        out[i, rng.permutation(vocab)] = zipf
    out += rng.normal(0.0, 0.5, size=out.shape).astype(np.float32)
    return out


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "Q: What is 17 times 3?\nA:",
           "<|im_start|>user\nWrite a haiku about rain.<|im_end|>\n<|im_start|>assistant\n",
           "import numpy as np\nx = np."]


def model_logits(model: str | None) -> np.ndarray:
    """(len(PROMPTS), V) float32: the model's next-token logits after each prompt (one prefill)."""
    from kvcore.cache.kv_cache import KVCache
    from kvcore.model import BatchInput, load_model
    from kvcore.model.hub import resolve_model
    from kvcore.model.tokenizer import Tokenizer

    model_dir = resolve_model(model)
    llama = load_model(model_dir)
    token_ids = [Tokenizer.from_dir(model_dir).encode(p) for p in PROMPTS]
    block_size = 16
    tables, num_blocks = [], 0
    for ids in token_ids:
        num = -(-len(ids) // block_size)
        tables.append(list(range(num_blocks, num_blocks + num)))
        num_blocks += num
    c = llama.config
    kv = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
    batch = BatchInput.build(token_ids, [0] * len(token_ids), tables, block_size)
    return np.ascontiguousarray(llama.forward(batch, kv), dtype=np.float32)


def make_rows(params: SamplingParams, batch: int
              ) -> tuple[list[SamplingRow], list[np.random.Generator | None]]:
    """The rows, and the reference sampler's generators for them."""
    seeds = np.random.SeedSequence(0)
    rng = np.random.default_rng(1)
    rows = [SamplingRow(params, rng.integers(0, 1000, 64).tolist(),
                        rng.integers(0, 1000, 16).tolist(), seed=i) for i in range(batch)]
    return rows, [None if params.greedy else make_generator(i, seeds) for i in range(batch)]


def validate(logits: np.ndarray, rows: list[SamplingRow], gens: list[np.random.Generator | None],
             today: Sampler, xp_sampler: XpSampler) -> None:
    want = today(logits.copy(), rows, gens).token_ids
    got = xp_sampler(logits.copy(), xp_sampler.batch(rows)).token_ids
    if rows[0].params.greedy:
        assert np.array_equal(got, want), "greedy tokens differ"
        return
    processed = logits.copy()
    process_logits(processed, rows, EOS)
    assert np.isfinite(processed[np.arange(len(rows)), got]).all(), "a dropped token was drawn"


def timed(fn: Callable[[np.ndarray], object], logits: np.ndarray, work: np.ndarray,
          clock: Callable[[], float]) -> float:
    np.copyto(work, logits)
    start = clock()
    fn(work)
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,32,256")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--model-logits", nargs="?", const="", default=None, metavar="MODEL_DIR",
                        help="the model's logits (default model when no MODEL_DIR) for Zipf's")
    args = parser.parse_args()
    real = None
    if args.model_logits is not None:
        real = model_logits(args.model_logits or None)  # (6, V)
        args.vocab = real.shape[1]
    vocab = args.vocab
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    today = Sampler(EOS)
    xp_sampler = XpSampler(EOS, vocab)
    source = "Zipf logits" if real is None else "model logits"
    print(f"{source}, vocab {vocab}, median of {args.repeats}, {args.clock} clock, "
          f"NumPy {np.__version__}, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'mode':<12} {'batch':>5} {'today us/row':>13} {'xp us/row':>10} "
          f"{'(batch build)':>13} {'xp / today':>10}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        logits = lm_logits(batch, vocab, seed=batch) if real is None else \
            real[np.arange(batch) % len(real)]  # (B, V)
        work = np.empty_like(logits)  # (B, V) the copy each call processes in place
        for mode, params in MODES.items():
            rows, gens = make_rows(params, batch)
            validate(logits, rows, gens, today, xp_sampler)
            t_today: list[float] = []
            t_xp: list[float] = []
            t_build: list[float] = []
            for _ in range(args.repeats):
                t_today.append(timed(lambda x, rows=rows, gens=gens: today(x, rows, gens), logits,
                                    work, clock))
                t_xp.append(timed(lambda x, rows=rows: xp_sampler(x, xp_sampler.batch(rows)),
                                  logits, work, clock))
                start = clock()
                xp_sampler.batch(rows)
                t_build.append(clock() - start)
            a, b = statistics.median(t_today), statistics.median(t_xp)
            build = statistics.median(t_build)
            print(f"{mode:<12} {batch:>5} {a / batch * 1e6:>13.1f} {b / batch * 1e6:>10.1f} "
                  f"{build / batch * 1e6:>13.1f} {b / a:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()

"""CPU paged attention alone (`kvcore.kernels.cpu.paged_attention`), per layer.

Decode batches of one token per sequence (uniform and mixed context lengths, shuffled blocks)
and one long prefill chunk, at the default model's head shapes (9 query heads, 3 KV heads,
head_dim 64, blocks of 16), fp32, on fresh random data. Prints the median time per layer call.

    .venv/bin/python tools/bench_attention.py [--threads N] [--repeats 5] [--gather]

`--gather` adds what bounds decode attention: the rate at which one step's K/V blocks are
gathered (np.take, as the kernel does) from 30 layers' caches (cold, as in a forward pass), with
the blocks shuffled as a long-running pool leaves them and consecutive, beside a plain read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# isort: off
import kvcore  # noqa: F401  (before NumPy: sets OpenBLAS's thread timeout, see kvcore/__init__)
import numpy as np
# isort: on

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def decode_case(rng: np.random.Generator, context_lens: np.ndarray) -> tuple:
    """(query, k_cache, v_cache, block_tables, context_lens, query_start_loc) for decode."""
    num_seqs = context_lens.size
    blocks = -(-context_lens // BLOCK_SIZE)
    num_blocks = int(blocks.sum()) + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)  # (num_blocks, bs, Hkv, D)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    perm = rng.permutation(num_blocks)
    tables = np.full((num_seqs, int(blocks.max())), -1, np.int32)  # (S, max_blocks)
    used = 0
    for s, n in enumerate(blocks):
        tables[s, :n] = perm[used:used + n]
        used += n
    query = rng.standard_normal((num_seqs, HEADS, HEAD_DIM), dtype=np.float32)  # (S, H, D)
    return (query, k_cache, v_cache, tables, context_lens.astype(np.int32),
            np.arange(num_seqs + 1, dtype=np.int32))


def prefill_case(rng: np.random.Generator, length: int) -> tuple:
    num_blocks = -(-length // BLOCK_SIZE)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    query = rng.standard_normal((length, HEADS, HEAD_DIM), dtype=np.float32)  # (T, H, D)
    return (query, k_cache, v_cache, np.arange(num_blocks, dtype=np.int32)[None],
            np.array([length], np.int32), np.array([0, length], np.int32))


def gather_rates(rng: np.random.Generator, repeats: int, num_seqs: int = 64,
                 context: int = 128, layers: int = 30) -> dict[str, float]:
    """GB/s read by gathering num_seqs x context tokens of K and V from each of `layers` caches,
    through shuffled and consecutive block tables, and by summing the same bytes in place."""
    per_seq = context // BLOCK_SIZE
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2 * layers)]
    out = np.empty((num_seqs, per_seq, *shape[1:]), np.float32)  # (S, nb, bs, Hkv, D)
    tables = {"shuffled blocks": rng.permutation(num_blocks).reshape(num_seqs, per_seq),
              "consecutive blocks": np.arange(num_blocks).reshape(num_seqs, per_seq)}
    runs = {name: (lambda t=t: [np.take(c, t, axis=0, out=out, mode="clip") for c in caches])
            for name, t in tables.items()}
    runs["plain read (sum)"] = lambda: [c.sum() for c in caches]
    total_bytes = sum(c.nbytes for c in caches)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeats + 1):
        for name, fn in runs.items():  # taking turns, so drifting load hits all alike
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    return {name: total_bytes / statistics.median(t) / 1e9 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None,
                   help="kvcore's kernel threads (default: $KVCORE_NUM_THREADS or all cores)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gather", action="store_true", help="also the K/V gather rates")
    args = p.parse_args()
    if args.threads is not None:
        os.environ["KVCORE_NUM_THREADS"] = str(args.threads)
    from kvcore.kernels import cpu as reference
    from kvcore.kernels.parallel import num_threads

    rng = np.random.default_rng(0)
    cases = {
        "decode 64 seqs x 128": decode_case(rng, np.full(64, 128)),
        "decode 256 seqs x 16-768 (mixed)": decode_case(rng, rng.integers(16, 769, 256)),
        "decode 32 seqs x 2048": decode_case(rng, np.full(32, 2048)),
        "prefill 2048 tokens": prefill_case(rng, 2048),
    }
    print(f"{num_threads()} kernel threads, median of {args.repeats}, ms per layer call")
    for name, case in cases.items():
        reference.paged_attention(*case, 0.125)  # warm-up (plan, scratch buffers)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            reference.paged_attention(*case, 0.125)
            times.append(time.perf_counter() - start)
        print(f"  {name:36s} {statistics.median(times) * 1e3:8.2f} ms")
    if args.gather:
        print("K/V gather of a 64 x 128 decode step over 30 layers' caches, GB/s read")
        for name, rate in gather_rates(rng, args.repeats).items():
            print(f"  {name:36s} {rate:8.1f} GB/s")


if __name__ == "__main__":
    main()

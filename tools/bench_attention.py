"""CPU paged attention alone (`kvcore.kernels.cpu.paged_attention`), per layer: the NumPy
kernel and the compiled (numba) one side by side, taking turns.

Decode batches of one token per sequence (uniform and mixed context lengths, shuffled blocks)
and one long prefill chunk, at the default model's head shapes (9 query heads, 3 KV heads,
head_dim 64, blocks of 16), fp32, on fresh random data. Prints the median time per layer call.

    .venv/bin/python tools/bench_attention.py [--threads N] [--repeats 5] [--gather] [--bound]

`--bound` adds decode attention against its memory bound, per cache dtype (fp32, fp16, bf16,
fp8, int4) at batch 32 x context 512 (`--bound-context`): the K/V bytes a layer must read (int4:
the sealed rows with their scales, and each sequence's last 32 tokens in the fp16 window) divided
by the read bandwidth
measured in the same run (a compiled parallel read of the same caches, same threads), over
several layers' caches in turn so that each call finds its cache cold, as in a forward pass.

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


def int4_case(case: tuple, window_tokens: int = 32) -> tuple:
    """A decode case's fp32 K/V as an int4 cache (kvcore.cache.int4's reference quantizer):
    each sequence's blocks sealed but those holding its last window_tokens, which sit in fp16
    window slots. Returns the case with Int4Layers and the bytes attention reads."""
    from kvcore.cache import int4
    from kvcore.kernels.int4_kv import Int4Layer

    query, k, v, tables, context_lens, starts = case
    num_blocks = k.shape[0]
    k_rows = np.stack([int4.quantize_key_block(b) for b in k])  # (num_blocks, K row bytes)
    v_rows = np.stack([int4.quantize_value_block(b) for b in v])  # (num_blocks, V row bytes)
    open_blocks = [int(tables[s, b]) for s, n in enumerate(context_lens)
                   for b in range((int(n) - window_tokens) // BLOCK_SIZE, -(-int(n) // BLOCK_SIZE))]
    window_slot = np.full(num_blocks, -1, np.int32)  # (num_blocks,) -1: sealed
    window_slot[open_blocks] = np.arange(len(open_blocks), dtype=np.int32)
    k_window = k[open_blocks].astype(np.float16)  # (slots, bs, Hkv, D)
    v_window = v[open_blocks].astype(np.float16)
    sealed = num_blocks - 1 - len(open_blocks)  # the last block of the pool is no one's
    nbytes = sealed * (k_rows.shape[1] + v_rows.shape[1]) + k_window.nbytes + v_window.nbytes
    layers = (Int4Layer(k_rows, k_window, window_slot, True, int4.DEFAULT_GROUP),
              Int4Layer(v_rows, v_window, window_slot, False, int4.DEFAULT_GROUP))
    return (query, *layers, tables, context_lens, starts), nbytes, [k_rows, v_rows, k_window,
                                                                   v_window]


def bound_rows(rng: np.random.Generator, repeats: int, layers: int = 8,
               context: int = 512) -> list[str]:
    """Compiled decode attention vs the time to read its K/V bytes, per cache dtype."""
    import ml_dtypes
    from numba import njit, prange

    from kvcore.kernels import cpu, cpu_numba

    @njit(parallel=True)
    def read(words: np.ndarray) -> np.uint64:  # every 8 bytes once, split over the threads
        total = np.uint64(0)  # uint64 throughout: int64 + uint64 would be float64 in numba
        for i in prange(words.shape[0]):
            total += words[i]
        return total

    base = [decode_case(rng, np.full(32, context)) for _ in range(layers)]
    rows = ["| cache dtype | K/V bytes per layer | read bandwidth | memory bound | numba | "
            "numba / bound | NumPy |", "|---|---|---|---|---|---|---|"]
    for name, dtype in (("fp32", np.float32), ("fp16", np.float16),
                        ("bf16", ml_dtypes.bfloat16), ("fp8", ml_dtypes.float8_e4m3fn),
                        ("int4", None)):
        scale = 0.05 if name == "fp8" else 1.0
        if dtype is None:
            int4_cases = [int4_case(c) for c in base]
            cases = [c for c, _, _ in int4_cases]
            nbytes = int4_cases[0][1]
            words = [a.reshape(-1).view(np.uint64) for _, _, arrays in int4_cases
                     for a in arrays]
        else:
            cases = [(c[0], (c[1] / scale).astype(dtype), (c[2] / scale).astype(dtype), *c[3:])
                     for c in base]
            # the bytes attention must read: each sequence's blocks, K and V (here: every block)
            nbytes = cases[0][1].nbytes + cases[0][2].nbytes
            words = [c[i].reshape(-1).view(np.uint64) for c in cases for i in (1, 2)]
        read(words[0])

        outs = []  # validate before timing: the compiled kernel against the NumPy one
        for compiled in (True, False):
            cpu_numba.set_enabled(compiled)
            outs.append(cpu.paged_attention(*cases[0], 0.125, None, scale, scale))
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-3, atol=1e-3, err_msg=name)

        def run(compiled: bool, cases: list = cases, scale: float = scale) -> None:
            cpu_numba.set_enabled(compiled)
            for c in cases:
                cpu.paged_attention(*c, 0.125, None, scale, scale)

        def run_read(words: list = words) -> None:
            for w in words:
                read(w)
        times: dict[str, list[float]] = {"numba": [], "numpy": [], "read": []}
        for i in range(repeats + 1):
            for label in ("numba", "numpy", "read"):
                start = time.perf_counter()
                run_read() if label == "read" else run(label == "numba")
                if i:
                    times[label].append((time.perf_counter() - start) / layers)
        cpu_numba.set_enabled(True)
        t = {k: statistics.median(v) for k, v in times.items()}
        rows.append(f"| {name} | {nbytes / 2**20:.1f} MiB | {nbytes / t['read'] / 1e9:.1f} GB/s | "
                    f"{t['read'] * 1e3:.2f} ms | {t['numba'] * 1e3:.2f} ms | "
                    f"{t['numba'] / t['read']:.2f}x | {t['numpy'] * 1e3:.2f} ms |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None,
                   help="kvcore's kernel threads (default: $KVCORE_NUM_THREADS or all cores)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gather", action="store_true", help="also the K/V gather rates")
    p.add_argument("--bound", action="store_true",
                   help="also decode attention vs its memory bound, per cache dtype")
    p.add_argument("--bound-context", type=int, default=512,
                   help="context of the --bound batch of 32 (default 512)")
    args = p.parse_args()
    if args.threads is not None:
        os.environ["KVCORE_NUM_THREADS"] = str(args.threads)
    from kvcore.kernels import cpu as reference
    from kvcore.kernels import cpu_numba
    from kvcore.kernels.parallel import num_threads

    rng = np.random.default_rng(0)
    cases = {
        "decode 64 seqs x 128": decode_case(rng, np.full(64, 128)),
        "decode 256 seqs x 16-768 (mixed)": decode_case(rng, rng.integers(16, 769, 256)),
        "decode 32 seqs x 512": decode_case(rng, np.full(32, 512)),
        "decode 32 seqs x 2048": decode_case(rng, np.full(32, 2048)),
        "decode 1 seq x 4096": decode_case(rng, np.full(1, 4096)),
        "prefill 2048 tokens": prefill_case(rng, 2048),
    }
    print(f"{num_threads()} kernel threads, median of {args.repeats}, ms per layer call: "
          "NumPy, numba, speed-up")
    for name, case in cases.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats + 1):  # the first round warms up (plans, scratch, JIT)
            for compiled in (False, True):
                cpu_numba.set_enabled(compiled)
                start = time.perf_counter()
                reference.paged_attention(*case, 0.125)
                if i:
                    times[compiled].append(time.perf_counter() - start)
        numpy_t, numba_t = statistics.median(times[False]), statistics.median(times[True])
        print(f"  {name:36s} {numpy_t * 1e3:8.2f} {numba_t * 1e3:8.2f} {numpy_t / numba_t:6.2f}x")
    cpu_numba.set_enabled(True)
    if args.gather:
        print("K/V gather of a 64 x 128 decode step over 30 layers' caches, GB/s read")
        for name, rate in gather_rates(rng, args.repeats).items():
            print(f"  {name:36s} {rate:8.1f} GB/s")
    if args.bound:
        print(f"decode attention, 32 x {args.bound_context}, vs its memory bound "
              f"({num_threads()} threads)")
        bound_rows(rng, args.repeats, context=args.bound_context)


if __name__ == "__main__":
    main()

"""CPU paged attention alone (`kvcore.kernels.cpu.paged_attention`), per layer: the NumPy
kernel and the compiled (numba) one side by side, taking turns.

Decode batches of one token per sequence (uniform and mixed context lengths, shuffled blocks)
and one long prefill chunk, at the default model's head shapes (9 query heads, 3 KV heads,
head_dim 64, blocks of 16), fp32, on fresh random data. Prints the median time per layer call.

    .venv/bin/python tools/bench_attention.py [--threads N] [--repeats 5] [--gather] [--bound]

`--bound` adds decode attention against its memory bound, per cache dtype (fp32, fp16, bf16,
fp8, int4) at batch 32 x context 512 (`--bound-context` to change it): the K/V bytes a layer
must read divided by the read bandwidth measured in the same run (a compiled parallel read of
the same caches, same threads), over several layers' caches in turn so that each call finds its
cache cold, as in a forward pass. int4 as in decode: every block sealed except each sequence's
last 32 tokens' blocks (its fp16 window); its bytes are the sealed rows and the window.

`--gather` adds what bounds decode attention: the rate at which one step's K/V blocks are
gathered (np.take, as the kernel does) from 30 layers' caches (cold, as in a forward pass), with
the blocks shuffled as a long-running pool leaves them and consecutive, beside a plain read.
"""

from __future__ import annotations

import argparse
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


def int4_case(case: tuple, window_tokens: int = 32, group: int = 32) -> tuple:
    """A decode case's caches as an int4 cache: blocks sealed (the format's bytes), except the
    blocks of each sequence's last window_tokens tokens, open in an fp16 window."""
    from kvcore.kernels.cpu import kv_int4_blocks
    from kvcore.kernels.cpu.kv_int4 import Int4Layer

    query, k_cache, v_cache, tables, lens, starts = case
    num_blocks = k_cache.shape[0]
    k16, v16 = k_cache.astype(np.float16), v_cache.astype(np.float16)
    k_rows = np.zeros((num_blocks, kv_int4_blocks.key_row_bytes(BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
                      np.uint8)
    v_rows = np.zeros((num_blocks, kv_int4_blocks.value_row_bytes(BLOCK_SIZE, KV_HEADS, HEAD_DIM,
                                                                  group)), np.uint8)
    every = np.arange(num_blocks)
    kv_int4_blocks.seal_blocks(k16.view(np.uint16), v16.view(np.uint16), k_rows, v_rows, every,
                               every, group)
    open_blocks = np.array([tables[s, b] for s, n in enumerate(lens)
                            for b in range(max(0, (n - window_tokens) // BLOCK_SIZE),
                                           -(-n // BLOCK_SIZE))])
    window_slot = np.full(num_blocks, -1, np.int32)  # (num_blocks,)
    window_slot[open_blocks] = np.arange(open_blocks.size)
    return (query, Int4Layer(k_rows, k16[open_blocks], window_slot, True, group),
            Int4Layer(v_rows, v16[open_blocks], window_slot, False, group), tables, lens,
            starts)


def bound_rows(rng: np.random.Generator, repeats: int, layers: int = 8,
               context: int = 512) -> list[str]:
    """Compiled decode attention vs the time to read its K/V bytes, per cache dtype."""
    import ml_dtypes
    from numba import njit, prange

    from kvcore.kernels import cpu
    from kvcore.kernels.cpu import jit

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
        if dtype is None:  # int4: sealed rows and the fp16 window
            cases = [int4_case(c) for c in base]
            held = [(c[i].rows, c[i].window) for c in cases for i in (1, 2)]
            arrays = [a for pair in held for a in pair]
            nbytes = sum(a.nbytes for a in arrays) // layers
        else:
            cases = [(c[0], (c[1] / scale).astype(dtype), (c[2] / scale).astype(dtype),
                      *c[3:]) for c in base]
            arrays = [c[i] for c in cases for i in (1, 2)]
            # the bytes attention must read: each sequence's blocks, K and V (every block)
            nbytes = cases[0][1].nbytes + cases[0][2].nbytes
        words = [a.reshape(-1).view(np.uint64) for a in arrays]
        read(words[0])

        def run(compiled: bool, cases: list = cases, scale: float = scale) -> None:
            jit.set_enabled(compiled)
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
        jit.set_enabled(True)
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
                   help="--bound's context per sequence (batch 32; default 512)")
    p.add_argument("--bound-only", action="store_true", help="--bound without the other cases")
    args = p.parse_args()
    from kvcore.kernels import cpu as reference
    from kvcore.kernels.cpu import jit
    from kvcore.kernels.cpu.threads import num_threads, set_num_threads

    if args.threads is not None:
        set_num_threads(args.threads)

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
    for name, case in ({} if args.bound_only else cases).items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for i in range(args.repeats + 1):  # the first round warms up (plans, scratch, JIT)
            for compiled in (False, True):
                jit.set_enabled(compiled)
                start = time.perf_counter()
                reference.paged_attention(*case, 0.125)
                if i:
                    times[compiled].append(time.perf_counter() - start)
        numpy_t, numba_t = statistics.median(times[False]), statistics.median(times[True])
        print(f"  {name:36s} {numpy_t * 1e3:8.2f} {numba_t * 1e3:8.2f} {numpy_t / numba_t:6.2f}x")
    jit.set_enabled(True)
    if args.gather:
        print("K/V gather of a 64 x 128 decode step over 30 layers' caches, GB/s read")
        for name, rate in gather_rates(rng, args.repeats).items():
            print(f"  {name:36s} {rate:8.1f} GB/s")
    if args.bound or args.bound_only:
        print(f"decode attention, 32 x {args.bound_context}, vs its memory bound "
              f"({num_threads()} threads)")
        bound_rows(rng, args.repeats, context=args.bound_context)


if __name__ == "__main__":
    main()

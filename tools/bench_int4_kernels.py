"""Decode attention over an int4 KV cache on a GPU, beside the fp16 cache at the same shape.

Llama-3-8B's attention shape (32 query / 8 KV heads, head_dim 128, block size 16, value groups
of 32): batch {1, 16, 64} x context {4096, 16384}. The int4 cache is built on the device the way
the engine builds it: fp16 window slots written, then sealed by the seal kernel; each sequence's
last block stays in the window. Before a kernel is timed its output is checked against a
float64 NumPy oracle over the dequantized cache (two sequences of every batch); a wrong kernel
exits 1 unmeasured. Bandwidth = the bytes the kernel must read (int4: nibbles, scales, zeros and
the window rows) / median kernel time (CUDA events), beside a device-to-device copy measured in
the same run. Prints a markdown table; exits 2 at once without a GPU.

    python tools/bench_int4_kernels.py [--quick] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copy_bandwidth, time_ms  # noqa: E402
from kvcore.device import cuda_available  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, GROUP = 32, 8, 128, 16, 32
BATCHES = (1, 16, 64)
CONTEXTS = (4096, 16384)
TOL = 3e-3


def in_order(launches: list[Any]) -> Any:
    """A function enqueuing `launches` in order."""
    def run() -> None:
        for launch in launches:
            launch()
    return run


def int4_inputs(cp: Any, batch: int, context: int, seed: int = 0) -> dict:
    """Random queries and an int4 cache with shuffled blocks: every block sealed from its fp16
    window slot (block i from slot i), then each sequence's last block reopened."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.kv_int4 import key_row_bytes, value_row_bytes

    per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * per_seq
    window_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_window = (cp.random.standard_normal(window_shape, dtype=cp.float32) * 2).astype(cp.float16)
    v_window = cp.random.standard_normal(window_shape, dtype=cp.float32).astype(cp.float16)
    k_rows = cp.empty((num_blocks, key_row_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)), cp.uint8)
    v_rows = cp.empty((num_blocks, value_row_bytes(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, GROUP)),
                      cp.uint8)
    ids = np.arange(num_blocks)
    cuda.ops().seal_blocks([k_rows], [v_rows], [k_window], [v_window],
                           np.stack([ids, ids], axis=1), GROUP)
    tables = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
    tables = tables.reshape(batch, per_seq)  # (S, max_blocks)
    window_slot = np.full(num_blocks, -1, np.int32)
    window_slot[tables[:, -1]] = tables[:, -1]  # the last block of each sequence stays open
    query = cp.random.standard_normal((batch, NUM_HEADS, HEAD_DIM),
                                      dtype=cp.float32).astype(cp.float16)  # (T, H, D)
    return dict(query=query, k_cache=k_rows, v_cache=v_rows, k_window=k_window,
                v_window=v_window, window_slot=cp.asarray(window_slot), block_tables=tables,
                context_lens=np.full(batch, context, np.int32),
                query_start_loc=np.arange(batch + 1, dtype=np.int32), scale=HEAD_DIM ** -0.5,
                sliding_window=None, group=GROUP)


def seq_rows(cp: Any, p: dict, seq: int, key: bool) -> np.ndarray:
    """Sequence `seq`'s K or V rows (ctx, Hkv, D) as the cache holds them, float64."""
    from kvcore.cache import int4

    rows = cp.asnumpy(p["k_cache" if key else "v_cache"])
    window = p["k_window" if key else "v_window"]
    slots = cp.asnumpy(p["window_slot"])
    out = []
    for block in p["block_tables"][seq].tolist():
        if slots[block] >= 0:
            out.append(cp.asnumpy(window[int(slots[block])]).astype(np.float32))
        elif key:
            out.append(int4.dequantize_key_block(rows[block], BLOCK_SIZE, NUM_KV_HEADS,
                                                 HEAD_DIM))
        else:
            out.append(int4.dequantize_value_block(rows[block], BLOCK_SIZE, NUM_KV_HEADS,
                                                   HEAD_DIM, GROUP))
    ctx = int(p["context_lens"][seq])
    return np.concatenate(out).astype(np.float64)[:ctx]


def check(cp: Any, out: Any, p: dict, seq: int) -> None:
    keys, values = seq_rows(cp, p, seq, True), seq_rows(cp, p, seq, False)
    group = NUM_HEADS // NUM_KV_HEADS
    query = cp.asnumpy(p["query"][seq]).astype(np.float64)  # (H, D)
    k, v = np.repeat(keys, group, axis=1), np.repeat(values, group, axis=1)  # (ctx, H, D)
    scores = np.einsum("hd,khd->hk", query, k) * p["scale"]
    w = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = np.einsum("hk,khd->hd", w, v) / w.sum(axis=1)[:, None]
    err = np.abs(cp.asnumpy(out[seq]).astype(np.float64) - want).max()
    if not np.isfinite(err) or err > TOL * (1 + np.abs(want).max()):
        raise ValueError(f"int4 decode: sequence {seq} differs from the float64 oracle by "
                         f"{err:.3g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 64 at 4,096 only")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("bench_int4_kernels: no CUDA GPU available (cupy finds no device); nothing "
              "measured", file=sys.stderr)
        return 2
    import cupy as cp

    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.attention import plan_paged_attention
    from kvcore.kernels.cuda.attention_kv_int4 import plan_int4_attention

    backend = cuda.ops().backend
    copy_gbs = copy_bandwidth(cp, args.iters)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; "
          f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| batch | context | fp16 (us) | int4 (us) | int4 / fp16 speed | int4 GB/s | "
          "% of copy |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch in (1, 64) if args.quick else BATCHES:
        for context in (4096,) if args.quick else CONTEXTS:
            p = int4_inputs(cp, batch, context)
            out, launches = plan_int4_attention(backend, **p)
            in_order(launches)()
            try:
                for seq in sorted({0, batch - 1}):
                    check(cp, out, p, seq)
            except ValueError as exc:
                print(f"bench_int4_kernels: {exc}; not timed", file=sys.stderr)
                return 1
            int4_ms = time_ms(cp, in_order(launches), args.iters)
            int4_bytes = (p["k_cache"][0].nbytes + p["v_cache"][0].nbytes) * \
                (p["k_cache"].shape[0] - batch) + 2 * batch * p["k_window"][0].nbytes
            dense = dict(query=p["query"], k_cache=p["k_window"], v_cache=p["v_window"],
                         block_tables=p["block_tables"], context_lens=p["context_lens"],
                         query_start_loc=p["query_start_loc"], scale=p["scale"])
            _, fp16_launches = plan_paged_attention(backend, **dense)  # the same tokens in fp16
            fp16_ms = time_ms(cp, in_order(fp16_launches), args.iters)
            gbs = int4_bytes / int4_ms / 1e6
            print(f"| {batch} | {context} | {fp16_ms * 1e3:.1f} | {int4_ms * 1e3:.1f} | "
                  f"{fp16_ms / int4_ms:.2f}x | {gbs:.0f} | {100 * gbs / copy_gbs:.0f}% |",
                  flush=True)
            del p, dense, out
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

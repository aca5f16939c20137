"""The xp sampler on NumPy vs CuPy: the noise bit for bit, and how often the tokens agree.

1. Uniforms (dense and per token) for 64 (seed, position) rows x 49,152 tokens: must be equal bit
   for bit (integer hash, exact conversion). The Gumbel transform goes through each device's
   log, so it is reported (bit-equal share, largest difference), not required to be equal.
2. Tokens of the same LM-shaped fp32 logits (batch 256, Zipf over a random permutation, as
   tools/bench_sampler.py) sampled on both devices, per setting; and CuPy on fp16 logits (the
   half model's) against NumPy on fp32: near-ties may flip there, the share is reported.
3. CuPy sampler time per step at batch 256 (after a warm-up, synchronized).

Without a usable CUDA GPU it says so and exits 0. Exit 1 when the noise differs or fp32 tokens
agree less than 99.9%.

    python tools/check_sampler_devices.py      # run by tools/gpu_check.sh
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from bench_sampler import lm_logits  # tools/ is on the path when a tool runs as a script
from kvcore.device import cuda_available, to_numpy
from kvcore.sampling import SamplingParams, SamplingRow, XpSampler
from kvcore.sampling.rng import gumbel_, row_keys, uniforms, uniforms_dense

VOCAB = 49152
BATCH = 256
EOS = (2,)
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=None),
    "temperature 0.8": SamplingParams(temperature=0.8, max_tokens=None),
    "temperature 1.0": SamplingParams(temperature=1.0, max_tokens=None),
    "top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95, max_tokens=None),
    "top_k 50, min_p 0.05": SamplingParams(temperature=1.0, top_k=50, min_p=0.05,
                                           max_tokens=None),
    "penalties": SamplingParams(temperature=0.9, repetition_penalty=1.2,
                                frequency_penalty=0.5, presence_penalty=0.3, max_tokens=None),
}


def check_noise(cupy: Any) -> bool:
    cp = cupy
    seeds = np.arange(64, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # (64,)
    positions = np.arange(64, dtype=np.int64) * 37
    host_keys = row_keys(seeds, positions)
    dev_keys = row_keys(cp.asarray(seeds), cp.asarray(positions))
    host = uniforms_dense(host_keys, VOCAB)  # (64, V)
    dev = to_numpy(uniforms_dense(dev_keys, VOCAB))
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(64, 512))  # (64, 512)
    sparse_ok = np.array_equal(uniforms(host_keys, ids).view(np.uint32),
                               to_numpy(uniforms(dev_keys, cp.asarray(ids))).view(np.uint32))
    dense_ok = np.array_equal(host.view(np.uint32), dev.view(np.uint32))
    keys_ok = np.array_equal(host_keys, to_numpy(dev_keys))
    g_host, g_dev = gumbel_(host.copy()), to_numpy(gumbel_(cp.asarray(host.copy())))
    same = float((g_host.view(np.uint32) == g_dev.view(np.uint32)).mean())
    print(f"noise: keys {'equal' if keys_ok else 'DIFFER'}, uniforms dense "
          f"{'equal' if dense_ok else 'DIFFER'} ({host.size} values), per token "
          f"{'equal' if sparse_ok else 'DIFFER'}; gumbel bit-equal {same:.6%}, "
          f"max |diff| {float(np.abs(g_host - g_dev).max()):.3g}")
    return keys_ok and dense_ok and sparse_ok


def rows_for(params: SamplingParams) -> list[SamplingRow]:
    rng = np.random.default_rng(1)
    return [SamplingRow(params, rng.integers(0, VOCAB, 32).tolist(),
                        rng.integers(0, VOCAB, 8).tolist(), seed=1000 + i)
            for i in range(BATCH)]


def check_tokens(cupy: Any) -> bool:
    cp = cupy
    host_sampler = XpSampler(EOS, VOCAB)
    dev_sampler = XpSampler(EOS, VOCAB, xp=cp)
    logits = lm_logits(BATCH, VOCAB, seed=3)  # (B, V)
    half = logits.astype(np.float16)
    ok = True
    print(f"{'setting':<22} {'fp32 agree':>10} {'fp16 vs fp32':>12} {'cupy ms/step':>12}")
    for name, params in SETTINGS.items():
        rows = rows_for(params)
        want = host_sampler(logits.copy(), host_sampler.batch(rows)).token_ids
        got = dev_sampler(cp.asarray(logits.copy()), dev_sampler.batch(rows)).token_ids
        got16 = dev_sampler(cp.asarray(half.copy()), dev_sampler.batch(rows)).token_ids
        agree, agree16 = float((got == want).mean()), float((got16 == want).mean())
        ok &= agree >= 0.999
        device_logits = cp.asarray(logits.copy())
        times = []
        for _ in range(6):
            work = device_logits.copy()
            cp.cuda.get_current_stream().synchronize()
            start = time.perf_counter()
            dev_sampler(work, dev_sampler.batch(rows))  # ends with the ids on the host
            times.append(time.perf_counter() - start)
        print(f"{name:<22} {agree:>10.2%} {agree16:>12.2%} {min(times[1:]) * 1e3:>12.2f}")
    return ok


def main() -> int:
    if not cuda_available():
        print("check_sampler_devices: no CUDA GPU available; nothing to compare")
        return 0
    import cupy

    ok = check_noise(cupy)
    ok &= check_tokens(cupy)
    print("check_sampler_devices:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

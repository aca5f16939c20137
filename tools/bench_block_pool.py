"""Benchmark KVCacheManager against a bare Python free-list allocator on one serving workload.

Workload (issue 2): a pool of 10,000 blocks of 16 tokens; 256 requests with 512-token prompts
admitted in two waves of 128; after each wave's admission every request takes 256 decode steps of
one token, then the wave is freed. Two variants: prefix caching off with distinct prompts, and
prefix caching on where every prompt shares a 384-token prefix (ideal hit rate 255 * 384 /
(256 * 512) = 0.747). Each run measures the manager and the baseline on the same data; the report
is the median of 5 runs. Times are per prefill admission (admission check + prefix lookup + slots
for the prompt) and per decode append per request-step, loop overhead included for both sides,
in process CPU time.

    .venv/bin/python tools/bench_block_pool.py [--json] [--runs 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcore.cache import Admission, KVCacheManager

NUM_BLOCKS = 10_000
BLOCK_SIZE = 16
NUM_REQUESTS = 256
WAVE = 128
PROMPT_LEN = 512
SHARED_PREFIX = 384
DECODE_STEPS = 256
VOCAB = 32_000


class FreeListAllocator:
    """The baseline: a Python list of free block ids, a dict of block tables, refcounts in a list
    and, with caching, a dict from Python's hash of (parent, block tokens) to a block id. No LRU
    order (a hit on a free block is skipped lazily when popped), no salt, no token comparison."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.block_size = block_size
        self.caching = caching
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # pop() from the end: block 0 first
        self.num_free = num_blocks
        self.ref = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.seqs: dict[str, list] = {}  # seq_id -> [block table, num_tokens, full-block hashes]
        self.num_queries = 0
        self.num_hits = 0

    def _pop(self) -> int:
        while True:
            block_id = self.free_ids.pop()
            if self.ref[block_id] == 0:  # else: a stale entry of a block a prefix hit took back
                break
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None
        self.ref[block_id] = 1
        self.num_free -= 1
        return block_id

    def admit(self, seq_id: str, prompt: list[int], tokens: list[int]) -> bool:
        bs = self.block_size
        n = len(prompt)
        if -(-n // bs) > self.num_free:
            return False
        table: list[int] = []
        hashes: list[int] = []
        if self.caching:
            parent = 0
            for start in range(0, (n - 1) // bs * bs, bs):
                h = hash((parent, tuple(prompt[start:start + bs])))
                block_id = self.cached.get(h)
                if block_id is None:
                    break
                if self.ref[block_id] == 0:
                    self.num_free -= 1
                self.ref[block_id] += 1
                table.append(block_id)
                hashes.append(h)
                parent = h
            self.num_queries += n
            self.num_hits += len(table) * bs
        seq = [table, len(table) * bs, hashes]
        self.seqs[seq_id] = seq
        self.append(seq_id, tokens, n - len(table) * bs)
        return True

    def append(self, seq_id: str, tokens: list[int], num_new: int) -> None:
        seq = self.seqs[seq_id]
        table = seq[0]
        end = seq[1] + num_new
        while len(table) * self.block_size < end:
            table.append(self._pop())
        seq[1] = end
        if self.caching and (num_new > 1 or end % self.block_size == 0):
            self._register(seq, tokens)

    def _register(self, seq: list, tokens: list[int]) -> None:
        bs = self.block_size
        table, end, hashes = seq
        for i in range(len(hashes), end // bs):
            h = hash((hashes[-1] if hashes else 0, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(h)
            if h not in self.cached:
                self.cached[h] = table[i]
                self.block_hash[table[i]] = h

    def free(self, seq_id: str) -> None:
        for block_id in reversed(self.seqs.pop(seq_id)[0]):
            self.ref[block_id] -= 1
            if self.ref[block_id] == 0:
                self.free_ids.append(block_id)
                self.num_free += 1


@dataclass(frozen=True, slots=True)
class RunResult:
    prefill_us: float
    decode_us: float
    free_us: float
    hit_rate: float


def make_requests(rng: random.Random, shared: bool) -> list[tuple[str, list[int], list[int]]]:
    """(seq_id, prompt, prompt + decode tokens) per request; the unshared parts are random."""
    prefix = [rng.randrange(VOCAB) for _ in range(SHARED_PREFIX)] if shared else []
    out = []
    for r in range(NUM_REQUESTS):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(PROMPT_LEN - len(prefix))]
        decoded = [rng.randrange(VOCAB) for _ in range(DECODE_STEPS)]
        out.append((f"req-{r}", prompt, prompt + decoded))
    return out


def drive(admit: Callable[[str, list[int], list[int]], None],
          append: Callable[[str, list[int]], None], free: Callable[[str], None],
          requests: list[tuple[str, list[int], list[int]]]) -> tuple[float, float, float]:
    """Run the two waves; returns the seconds spent in prefill, decode and free."""
    t_prefill = t_decode = t_free = 0.0
    # CPU time of this process: on a shared machine, time spent waiting for a core is not the
    # allocator's cost (the workload is single-threaded and does no I/O)
    clock = time.process_time
    for w in range(0, NUM_REQUESTS, WAVE):
        wave = requests[w:w + WAVE]
        t0 = clock()
        for seq_id, prompt, tokens in wave:
            admit(seq_id, prompt, tokens)
        t1 = clock()
        for _ in range(DECODE_STEPS):
            for seq_id, _prompt, tokens in wave:
                append(seq_id, tokens)
        t2 = clock()
        for seq_id, _prompt, _tokens in wave:
            free(seq_id)
        t3 = clock()
        t_prefill += t1 - t0
        t_decode += t2 - t1
        t_free += t3 - t2
    return t_prefill, t_decode, t_free


def run_manager(requests: list[tuple[str, list[int], list[int]]], caching: bool) -> RunResult:
    m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=caching)

    def admit(seq_id: str, prompt: list[int], tokens: list[int]) -> None:
        if m.admission(len(prompt)) is not Admission.OK:
            raise RuntimeError("benchmark pool too small")
        num_cached = m.allocate_prefix(seq_id, prompt)
        if m.allocate_slots(seq_id, tokens, len(prompt) - num_cached) is None:
            raise RuntimeError("benchmark pool too small")

    allocate_slots = m.allocate_slots

    def append(seq_id: str, tokens: list[int]) -> None:
        allocate_slots(seq_id, tokens, 1)

    t = drive(admit, append, m.free, requests)
    assert m.usage() == 0.0
    hit_rate = m.num_prefix_hits / m.num_prefix_queries if m.num_prefix_queries else 0.0
    return _result(t, hit_rate)


def run_baseline(requests: list[tuple[str, list[int], list[int]]], caching: bool) -> RunResult:
    b = FreeListAllocator(NUM_BLOCKS, BLOCK_SIZE, caching)

    def admit(seq_id: str, prompt: list[int], tokens: list[int]) -> None:
        if not b.admit(seq_id, prompt, tokens):
            raise RuntimeError("benchmark pool too small")

    b_append = b.append

    def append(seq_id: str, tokens: list[int]) -> None:
        b_append(seq_id, tokens, 1)

    t = drive(admit, append, b.free, requests)
    assert b.num_free == NUM_BLOCKS
    return _result(t, b.num_hits / b.num_queries if b.num_queries else 0.0)


def _result(t: tuple[float, float, float], hit_rate: float) -> RunResult:
    return RunResult(prefill_us=t[0] / NUM_REQUESTS * 1e6,
                     decode_us=t[1] / (NUM_REQUESTS * DECODE_STEPS) * 1e6,
                     free_us=t[2] / NUM_REQUESTS * 1e6, hit_rate=hit_rate)


def bench(caching: bool, runs: int, seed: int) -> dict[str, float]:
    ours: list[RunResult] = []
    base: list[RunResult] = []
    for r in range(runs):
        requests = make_requests(random.Random(seed + r), shared=caching)
        gc.collect()
        gc.disable()  # as timeit does: a collection mid-loop would land on one side only
        try:
            ours.append(run_manager(requests, caching))
            base.append(run_baseline(requests, caching))
        finally:
            gc.enable()
    med = statistics.median
    return {
        "prefill_us": med(x.prefill_us for x in ours),
        "decode_us": med(x.decode_us for x in ours),
        "free_us": med(x.free_us for x in ours),
        "hit_rate": med(x.hit_rate for x in ours),
        "baseline_prefill_us": med(x.prefill_us for x in base),
        "baseline_decode_us": med(x.decode_us for x in base),
        "baseline_free_us": med(x.free_us for x in base),
        "baseline_hit_rate": med(x.hit_rate for x in base),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=5, help="runs per variant (median reported)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    cached = bench(True, args.runs, args.seed)
    plain = bench(False, args.runs, args.seed)
    if args.json:
        out = {k: round(v, 4) for k, v in cached.items()}
        out.update({f"no_caching_{k}": round(v, 4) for k, v in plain.items()
                    if "hit_rate" not in k})
        print(json.dumps(out))
        return
    print(f"block pool: {NUM_BLOCKS} blocks of {BLOCK_SIZE}, {NUM_REQUESTS} requests x "
          f"{PROMPT_LEN}-token prompts (waves of {WAVE}), {DECODE_STEPS} decode steps; "
          f"median of {args.runs} runs")
    print(f"{'variant':<48}{'prefill us':>12}{'decode us':>11}{'free us':>9}{'hit rate':>10}")
    for name, res in (("prefix caching, 384 shared", cached), ("no prefix caching", plain)):
        for side, prefix in (("KVCacheManager", ""), ("free-list baseline", "baseline_")):
            print(f"{name + ' / ' + side:<48}{res[prefix + 'prefill_us']:>12.2f}"
                  f"{res[prefix + 'decode_us']:>11.3f}{res[prefix + 'free_us']:>9.2f}"
                  f"{res[prefix + 'hit_rate']:>10.3f}")
        print(f"{name + ' / ratio':<48}{res['prefill_us'] / res['baseline_prefill_us']:>11.2f}x"
              f"{res['decode_us'] / res['baseline_decode_us']:>10.2f}x"
              f"{res['free_us'] / res['baseline_free_us']:>8.2f}x")


if __name__ == "__main__":
    main()

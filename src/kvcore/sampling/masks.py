"""The token bitmasks of a step's constrained rows, filled by llguidance in a worker thread
while the forward pass runs, and the histogram of their times."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

if TYPE_CHECKING:
    from kvcore.sampling.constraints import SeqMatcher

MASK_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class MaskTimes:
    """A histogram of the seconds each step's mask computation took (host data, read by the
    service's metrics at scrape time)."""

    def __init__(self, buckets: tuple[float, ...] = MASK_TIME_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.total = 0.0

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(bucket upper edges, counts per bucket + one above all, sum of seconds)."""
        return self.buckets, tuple(self.counts), self.total

    def observe(self, seconds: float) -> None:
        i = next((i for i, edge in enumerate(self.buckets) if seconds <= edge), len(self.buckets))
        self.counts[i] += 1
        self.total += seconds


class MaskFiller:
    """Fills the token bitmasks of a step's constrained rows, (C, ceil(V / 32)) int32, in a
    worker thread while the forward pass runs: llguidance fills the rows in parallel without
    the GIL."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.num_words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvcore-mask")
        self.times = MaskTimes()

    def fill(self, matchers: Sequence[SeqMatcher]) -> np.ndarray:
        start = time.perf_counter()
        masks = np.empty((len(matchers), self.num_words), dtype=np.int32)  # (C, W)
        fill_next_token_bitmask_par(self._executor,
                                    [(m.matcher, i) for i, m in enumerate(matchers)], masks)
        self.times.observe(time.perf_counter() - start)
        return masks

    def submit(self, job: Callable[[], np.ndarray]) -> Future[np.ndarray]:
        """Run `job` (which calls fill) in the mask worker, in submission order."""
        return self._worker.submit(job)

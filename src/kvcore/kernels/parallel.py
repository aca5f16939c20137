"""A small thread pool for the CPU kernels: NumPy releases the GIL in gathers, GEMMs and ufuncs.

BLAS parallelizes each large GEMM by itself, but the attention of a decode batch is many small
GEMMs and memory-bound gathers that run on one core; splitting the batch over the cores' threads
is what puts the other cores to work there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_blas: Any = None  # threadpoolctl's controller of the loaded BLAS libraries, made on first use


def num_threads() -> int:
    """$KVCORE_NUM_THREADS, else the cores this process may run on."""
    value = os.environ.get("KVCORE_NUM_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"KVCORE_NUM_THREADS must be a positive integer, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    with _lock:
        if _pool is None or _pool_threads != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcore-kernel")
            _pool_threads = threads
        return _pool


def split(total: int, min_part: int) -> list[range]:
    """[0, total) as up to num_threads() contiguous ranges of at least min_part items."""
    if total <= 0:
        return []
    parts = max(1, min(num_threads(), total // max(min_part, 1)))
    bounds = [total * i // parts for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def _blas_controller() -> Any:
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas")
    return _blas


def run_parallel(fn: Callable[[T], None], items: Sequence[T]) -> None:
    """fn(item) for every item, on the pool when there is more than one, else inline.

    While the pool works, BLAS runs one thread per call: each pool thread already holds a
    core, and BLAS's own threads on top would oversubscribe them (and pay a thread hand-off
    on every small GEMM)."""
    if len(items) <= 1 or threading.current_thread().name.startswith("kvcore-kernel"):
        for item in items:
            fn(item)
        return
    with _blas_controller().limit(limits=1):
        for future in [_executor(num_threads()).submit(fn, item) for item in items]:
            future.result()  # re-raises a worker's exception here

"""A small thread pool for the CPU kernels: NumPy releases the GIL in gathers, GEMMs and ufuncs.

BLAS parallelizes each large GEMM by itself, but the attention of a decode batch is many small
GEMMs and memory-bound gathers that run on one core; splitting the batch over the cores' threads
is what puts the other cores to work there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0
_blas: Any = None  # threadpoolctl's controller of the loaded BLAS libraries, made on first use
_inside = threading.local()  # .active: this thread is running an item of a run_parallel


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
    """fn(item) for every item: the first on the calling thread, the others on the pool (inline
    when there is one item, or when called from inside another run_parallel).

    While the pool works, BLAS runs one thread per call: each pool thread already holds a
    core, and BLAS's own threads on top would oversubscribe them (and pay a thread hand-off
    on every small GEMM). The caller takes an item itself rather than wait idle: one thread
    hand-off fewer (a submit and its wait: about 100 us on a 2-core VM, measured)."""
    if len(items) <= 1 or getattr(_inside, "active", False) or \
            threading.current_thread().name.startswith("kvcore-kernel"):
        for item in items:
            fn(item)
        return
    with _blas_controller().limit(limits=1):
        futures = [_executor(num_threads()).submit(fn, item) for item in items[1:]]
        _inside.active = True
        try:
            fn(items[0])
        finally:
            _inside.active = False
            wait(futures)  # never return (or raise) while a worker still writes shared output
        for future in futures:
            future.result()  # re-raises a worker's exception here

"""The CPU kernels' threads, sized once: $KVCORE_NUM_THREADS, else the cores in this process's
affinity mask, read when the process first asks (the engine's start-up) and never again per call.

Two pools run on them, one at a time: numba's (the compiled regions: attention, the fused decode
step; its threading layer chosen explicitly by kvcore.kernels.cpu.jit and logged) and a small
Python pool (`run_parallel`) for the per-op path's NumPy and single-threaded numba calls, which
release the GIL. A forward pass calls them in turn, never beside each other.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_threads = 0  # 0: not sized yet
_pool: ThreadPoolExecutor | None = None
_blas: Any = None  # threadpoolctl's controller of the loaded BLAS libraries, made on first use
_inside = threading.local()  # .active: this thread is running an item of a run_parallel


def threads_from_environment() -> int:
    """$KVCORE_NUM_THREADS, else the cores this process may run on (its affinity mask)."""
    value = os.environ.get("KVCORE_NUM_THREADS")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"KVCORE_NUM_THREADS must be a positive integer, got {value!r}")
        return int(value)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def num_threads() -> int:
    """The kernels' thread count: sized on first use, then a plain read."""
    return _threads or set_num_threads(threads_from_environment())


def set_num_threads(threads: int) -> int:
    """Size the kernels' threads (start-up; tests and tools that compare thread counts); the
    Python pool is rebuilt at the new size."""
    global _threads, _pool
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with _lock:
        if threads != _threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = None
            _threads = threads
    return threads


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max(1, _threads - 1), thread_name_prefix="kvcore-kernel")
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
        pool = _executor()
        futures = [pool.submit(fn, item) for item in items[1:]]
        _inside.active = True
        try:
            fn(items[0])
        finally:
            _inside.active = False
            wait(futures)  # never return (or raise) while a worker still writes shared output
        for future in futures:
            future.result()  # re-raises a worker's exception here

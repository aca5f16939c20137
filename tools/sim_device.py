"""A simulated device stream for tools/bench_host_overhead.py's GPU-shaped mode.

Work submitted at time t starts at max(t, the end of the work before it) and ends a fixed
step later, as on a CUDA stream. Its result is computed at once, in the submitting thread, but
can be read only at its end: `result()` sleeps until then (releasing the GIL). The device itself
never needs the GIL, as a GPU does not: a worker-thread device would, and a busy host would hold
it back for up to sys.getswitchinterval() (5 ms) before each step could start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class _Timed(Future):  # type: ignore[type-arg]
    def __init__(self, stream: TimelineStream, end: float) -> None:
        super().__init__()
        self._stream = stream
        self._end = end

    def result(self, timeout: float | None = None) -> Any:
        # device work reading an earlier step's output (a pending-token gather) is stream-
        # ordered after it: no wait; the host waits until the step has ended
        if not self._stream.inside:
            delay = self._end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        return super().result(timeout)


class TimelineStream:
    """`submit(work) -> Future` like kvcore.engine.runner's streams; `spans` records each
    step's simulated (start, end) in time.perf_counter() seconds."""

    def __init__(self, step_s: float) -> None:
        if step_s <= 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        self.step_s = step_s
        self.spans: list[tuple[float, float]] = []
        self.inside = False  # running submitted work now (the device's view of the futures)
        self._end = 0.0

    def submit(self, work: Callable[[], T]) -> Future[T]:
        start = max(time.perf_counter(), self._end)
        self._end = end = start + self.step_s
        future = _Timed(self, end)
        self.inside = True
        try:
            future.set_result(work())
        except Exception as e:
            future.set_exception(e)
        finally:
            self.inside = False
        self.spans.append((start, end))
        return future  # type: ignore[return-value]

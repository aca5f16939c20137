"""The GPU side of the tiers' copy path (PageCopier's TierStreams over CuPy): the tier's own
non-blocking stream, pinned host buffers (CuPy's pinned memory pool), and events that order the
tier stream after the compute queued so far and the compute after the tier's copies. The host
never waits here; only the tier's writer thread waits for a download's event."""

from __future__ import annotations

from typing import Any

import numpy as np


class CupyTierStreams:
    """TierStreams on the current CUDA device; the compute stream is the one current when a
    step's device work runs (the engine's)."""

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found]
        import cupyx  # type: ignore[import-not-found]

        self.xp = cupy
        self._cupyx = cupyx
        self._stream = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, nbytes: int) -> np.ndarray:
        return self._cupyx.empty_pinned((nbytes,), dtype=np.uint8)  # type: ignore[no-any-return]

    def tier(self) -> Any:
        return self._stream  # `with stream:` makes it current

    def _event(self, stream: Any) -> Any:
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def tier_waits_compute(self) -> None:
        self._stream.wait_event(self._event(self.xp.cuda.get_current_stream()))

    def compute_waits_tier(self) -> Any:
        event = self._event(self._stream)
        self.xp.cuda.get_current_stream().wait_event(event)
        return event

    def download(self, src: Any, dst: np.ndarray) -> Any:
        try:  # asynchronous into pinned memory (CuPy >= 13 blocks unless told not to)
            src.get(stream=self._stream, out=dst, blocking=False)
        except TypeError:  # an older CuPy: get() on a stream is asynchronous already
            src.get(stream=self._stream, out=dst)
        return self._event(self._stream)

    def upload(self, src: np.ndarray, dst: Any) -> None:
        dst.set(src, stream=self._stream)

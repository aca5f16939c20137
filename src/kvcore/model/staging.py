"""Pinned host staging for a step's inputs: one reused buffer per batch field, one copy per field.

A step's inputs (token ids, positions, slot mapping, block tables ...) are built on the host. From
pageable NumPy memory every host-to-device copy is synchronous (the driver stages it through a
pinned bounce buffer first), so the host would wait for the device to drain before it could go
on. `HostStaging` copies each field into a page-locked buffer kept for that field (grown by
doubling, never freed) and issues one asynchronous copy per field on the current stream.

Two buffer sets alternate, each guarded by an event recorded after its copies: a set is written
again only once the copies that read it have run, so the host building step N+1 never overwrites
what step N's still-queued copies are about to read.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class Event(Protocol):
    def synchronize(self) -> None: ...


class StagingBackend(Protocol):
    """What HostStaging needs of a device (CuPy here; a NumPy stand-in in the tests)."""

    def pinned(self, nbytes: int) -> np.ndarray: ...  # (nbytes,) uint8, page-locked

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any: ...  # on the device

    def copy_async(self, dst: Any, src: np.ndarray) -> None: ...  # host -> device, stream order

    def record(self) -> Event: ...  # an event after everything queued so far


class HostStaging:
    """Per-field pinned buffers, two alternating sets; `upload` per field, `end_step` once."""

    def __init__(self, backend: StagingBackend) -> None:
        self.backend = backend
        self._sets: list[dict[str, np.ndarray]] = [{}, {}]
        self._events: list[Event | None] = [None, None]
        self._current = 0
        self._waited = False
        self.num_copies = 0  # host-to-device copies issued (for tests and benchmarks)

    def _buffer(self, name: str, nbytes: int) -> np.ndarray:
        if not self._waited:
            event = self._events[self._current]
            if event is not None:
                event.synchronize()  # this set's previous copies have read it
            self._waited = True
        buffers = self._sets[self._current]
        buf = buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.nbytes), 256)
            buf = buffers[name] = self.backend.pinned(size)
        return buf

    def upload(self, name: str, host: np.ndarray, dst: Any = None) -> Any:
        """Copy `host` through field `name`'s pinned buffer into `dst` (a new device array of
        host's shape and dtype when None); returns the device array. The copy is queued, not
        finished: it is ordered before any work queued after it on the same stream."""
        host = np.ascontiguousarray(host)
        if dst is not None and (tuple(dst.shape) != host.shape or dst.dtype != host.dtype):
            raise ValueError(f"field {name!r}: dst is {dst.dtype} {tuple(dst.shape)}, the host "
                             f"array {host.dtype} {host.shape}")
        staged = self._buffer(name, host.nbytes)[:host.nbytes].view(host.dtype).reshape(
            host.shape)  # a view of the pinned buffer
        staged[...] = host
        if dst is None:
            dst = self.backend.empty(host.shape, host.dtype)
        self.backend.copy_async(dst, staged)
        self.num_copies += 1
        return dst

    def end_step(self) -> None:
        """After a step's uploads: guard this set with an event and switch to the other one."""
        self._events[self._current] = self.backend.record()
        self._current ^= 1
        self._waited = False


class CupyStaging:
    """StagingBackend over CuPy: cupyx pinned memory, copies and events on the current stream."""

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found]
        import cupyx  # type: ignore[import-not-found]

        self._cupy = cupy
        self._cupyx = cupyx

    def pinned(self, nbytes: int) -> np.ndarray:
        return self._cupyx.empty_pinned((nbytes,), dtype=np.uint8)  # type: ignore[no-any-return]

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self._cupy.empty(shape, dtype=dtype)

    def copy_async(self, dst: Any, src: np.ndarray) -> None:
        dst.set(src, stream=self._cupy.cuda.get_current_stream())

    def record(self) -> Event:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self._cupy.cuda.get_current_stream())
        return event  # type: ignore[no-any-return]

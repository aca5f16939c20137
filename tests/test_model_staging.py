"""HostStaging's bookkeeping on a NumPy stand-in device: one copy per field per step, buffers kept
and grown, two alternating sets each rewritten only after its event."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvcore.model.staging import HostStaging


class FakeEvent:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def synchronize(self) -> None:  # the stream reaches the event: the copies before it run
        self.backend.log.append(f"wait {self.name}")
        self.backend.run_queue()


class FakeBackend:
    """Pinned buffers are NumPy arrays; copies are queued and run when an event is waited on,
    like a stream that has not reached them yet."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.allocated: list[np.ndarray] = []
        self.queued: list[tuple[np.ndarray, np.ndarray]] = []
        self.num_events = 0

    def pinned(self, nbytes: int) -> np.ndarray:
        buf = np.empty(nbytes, np.uint8)
        self.allocated.append(buf)
        return buf

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return np.full(shape, -7, dtype=dtype)

    def copy_async(self, dst: Any, src: np.ndarray) -> None:
        self.queued.append((dst, src))  # src is a view of the pinned buffer: read later

    def run_queue(self) -> None:
        for dst, src in self.queued:
            np.copyto(dst, src)
        self.queued.clear()

    def record(self) -> FakeEvent:
        self.num_events += 1
        return FakeEvent(self, f"e{self.num_events}")


def test_one_copy_per_field_and_buffers_reused_then_grown() -> None:
    backend = FakeBackend()
    staging = HostStaging(backend)
    rng = np.random.default_rng(0)
    results = []
    for step in range(6):
        fields = {"input_ids": rng.integers(0, 1000, size=5 + step),  # (T,) int64
                  "block_tables": rng.integers(-1, 50, size=(3, 4)).astype(np.int32)}
        out = {name: staging.upload(name, host) for name, host in fields.items()}
        staging.end_step()
        backend.run_queue()
        results.append((fields, out))
    for fields, out in results:  # each device array got exactly its step's host data
        for name, host in fields.items():
            assert out[name].dtype == host.dtype and np.array_equal(out[name], host)
    assert staging.num_copies == 12
    # two sets x two fields, input_ids grown once per set at most (256-byte minimum first)
    assert 4 <= len(backend.allocated) <= 6


def test_a_set_is_rewritten_only_after_its_copies_ran() -> None:
    backend = FakeBackend()
    staging = HostStaging(backend)
    a = np.arange(8, dtype=np.int64)  # (8,)
    out_a = staging.upload("x", a)
    staging.end_step()  # set 0 guarded by e1
    out_b = staging.upload("x", a + 100)  # set 1: no wait (never used)
    staging.end_step()  # e2
    assert backend.log == []
    staging.upload("x", a + 200)  # set 0 again: must wait for e1 first
    assert backend.log == ["wait e1"]
    backend.run_queue()
    assert np.array_equal(out_a, a) and np.array_equal(out_b, a + 100)


def test_upload_into_a_given_buffer_keeps_its_shape() -> None:
    backend = FakeBackend()
    staging = HostStaging(backend)
    dst = np.zeros((2, 3), np.int32)
    src = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert staging.upload("t", src, dst) is dst
    backend.run_queue()
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="field 't'"):
        staging.upload("t", np.arange(7, dtype=np.int32), dst)

"""The model runner: a SchedulerOutput -> one BatchInput -> forward -> logits of sampling rows.

A step is launched in two halves: the host half (build the BatchInput, now, while the block
tables the SchedulerOutput points at are valid) and the device half (fill pending tokens, block
copies, forward, the caller's sampling), submitted to a `DeviceStream` that runs device work in
submission order. `launch` returns a Future; its `result()` waits for the device half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.cache.kv_cache import KVCache
from kvcore.device import array_module, to_numpy
from kvcore.model import BatchInput, InputFill
from kvcore.scheduler import SchedulerOutput

T = TypeVar("T")


class Model(Protocol):
    def forward(self, batch: BatchInput, kv_cache: KVCache) -> np.ndarray: ...


class DeviceStream(Protocol):
    """Runs submitted work in submission order (a CUDA stream's order): a step's device work
    sees every earlier step's writes, and a block freed on the host while an earlier step
    still writes it is written again only by later steps."""

    def submit(self, work: Callable[[], T]) -> Future[T]: ...


class InlineStream:
    """Runs the work at once, in the caller's thread. NumPy's forward is synchronous; CuPy's
    kernel launches are asynchronous already (the host waits where it reads a result back)."""

    def submit(self, work: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(work())
        except Exception as e:
            future.set_exception(e)
        return future


class WorkerStream:
    """One worker thread, FIFO: a device whose work runs while the host goes on (the fake
    device of the tests and of tools/bench_host_overhead.py's GPU-shaped mode)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcore-device")

    def submit(self, work: Callable[[], T]) -> Future[T]:
        return self._executor.submit(work)

    def close(self) -> None:
        self._executor.shutdown()


@dataclass(frozen=True, slots=True)
class PendingFill:
    """Where the pending tokens of a step come from: the step launched before it sampled them.
    `token_ids()` is that step's sampled ids (device array), `row_of` a sequence's row in it."""

    token_ids: Callable[[], Any]
    row_of: Mapping[str, int]


class ModelRunner:
    """Runs the block copies, builds one BatchInput per step (one pass over the batch, one host
    array per field) and the forward pass. The SchedulerOutput is all it reads: only the
    sequences whose chunk reaches the end of their tokens want logits."""

    def __init__(self, model: Model, kv_cache: KVCache, block_size: int,
                 stream: DeviceStream | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.stream: DeviceStream = stream if stream is not None else InlineStream()

    def launch(self, output: SchedulerOutput, sample: Callable[[Any], T],
               fill: PendingFill | None = None) -> Future[T]:
        """Launch one step: its future holds sample(logits of its L sampling rows, in row
        order). A token that is PENDING_TOKEN_ID (the last of its sequence, sampled by the step
        launched before) is filled on the device from `fill`, without a host round trip. A
        failure (here or on the device) is the future's exception.

        A model on a device (its `xp` is not NumPy) keeps its logits there through
        `forward_device` (CuPy on the GPU: the engine core samples them there); on the CPU
        `forward` gives host logits."""
        try:
            scheduled = output.scheduled
            batch = BatchInput.build([s.token_ids for s in scheduled],
                                     [s.start for s in scheduled],
                                     [s.block_ids for s in scheduled], self.block_size,
                                     [s.sample + s.num_draft_tokens if s.sample else 0
                                      for s in scheduled])
            pending = np.flatnonzero(batch.input_ids == PENDING_TOKEN_ID)  # (P,) rows
            src = None
            if len(pending):
                if fill is None:
                    raise ValueError(f"{len(pending)} pending tokens and no step to fill "
                                     f"them from")
                seq_index = np.searchsorted(batch.query_start_loc, pending, side="right") - 1
                row_of = fill.row_of
                src = np.array([row_of[scheduled[s].seq_id] for s in seq_index.tolist()],
                               dtype=np.int64)  # (P,) rows of the previous step's samples
        except Exception as e:
            failed: Future[T] = Future()
            failed.set_exception(e)
            return failed
        copy_ops = output.copy_ops
        model = self.model
        kv_cache = self.kv_cache
        window_ops = kv_cache.take_window_ops()  # int4: its fp16 window's slot moves and seals
        forward: Callable[..., Any] = (model.forward_device  # type: ignore[attr-defined]
                                       if getattr(model, "xp", np) is not np else model.forward)
        # a model that takes an InputFill gathers the pending ids on its device; another one
        # gets them read back into the host batch (waiting for the step that sampled them)
        on_device = getattr(model, "supports_input_fill", False)

        def device_work() -> T:
            model_fill = None
            if src is not None:
                assert fill is not None
                ids = fill.token_ids()  # the previous step's samples (stream order: done)
                gathered = ids[array_module(ids).asarray(src)]  # (P,) on their device
                if on_device:
                    batch.input_ids[pending] = 0  # any valid id: the device overwrites it
                    model_fill = InputFill(pending, gathered)
                else:
                    batch.input_ids[pending] = to_numpy(gathered)
            if window_ops:
                kv_cache.apply_window_ops(window_ops)
            if copy_ops:
                kv_cache.copy_blocks(copy_ops)
            if model_fill is None:
                return sample(forward(batch, kv_cache))
            return sample(forward(batch, kv_cache, fill=model_fill))
        return self.stream.submit(device_work)

"""The model runner: a SchedulerOutput -> one BatchInput -> forward -> logits of sampling rows.

A step is launched in two halves: the host half (build the BatchInput, now, while the block
tables the SchedulerOutput points at are valid) and the device half (fill pending tokens, block
copies, forward, the caller's sampling), submitted to a `DeviceStream` that runs device work in
submission order. `launch` returns a Future; its `result()` waits for the device half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import numpy as np

from kvcore.cache import PENDING_TOKEN_ID
from kvcore.cache.kv_cache import KVCache
from kvcore.device import array_module
from kvcore.engine.tier_driver import TierDriver
from kvcore.model import BatchInput, InputFill
from kvcore.scheduler import SchedulerOutput

T = TypeVar("T")


class Model(Protocol):
    # also forward(batch, kv_cache, fill=InputFill) when a step has pending tokens (async
    # scheduling), and forward_device(...) alike for a model whose `xp` is not NumPy
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


class PrevStep(Protocol):
    """The step launched before, whose samples fill a step's pending tokens."""

    @property
    def row_of(self) -> Mapping[str, int]: ...  # a sequence's row among its samples

    def device_ids(self) -> Any: ...  # (P,) its sampled token ids, on their device


class ModelRunner:
    """Runs the block copies, builds one BatchInput per step (one pass over the batch, one host
    array per field) and the forward pass. The SchedulerOutput is all it reads: only the
    sequences whose chunk reaches the end of their tokens want logits."""

    def __init__(self, model: Model, kv_cache: KVCache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.stream: DeviceStream = InlineStream()  # a fake device's stream replaces it in tests
        self.tiers: TierDriver | None = None  # the KV tiers' copies, run before the forward

    def launch(self, output: SchedulerOutput, sample: Callable[[Any], T],
               prev: PrevStep | None = None) -> Future[T]:
        """Launch one step: its future holds sample(logits of its L sampling rows, in row
        order). A token that is PENDING_TOKEN_ID (the last of its sequence, sampled by the step
        launched before) is filled on the device from `prev`, without a host round trip: the
        model takes `forward(..., fill=InputFill)`. A failure (here or on the device) is the
        future's exception.

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
                if prev is None:
                    raise ValueError(f"{len(pending)} pending tokens and no step to fill "
                                     f"them from")
                seq_index = np.searchsorted(batch.query_start_loc, pending, side="right") - 1
                row_of = prev.row_of
                src = np.array([row_of[scheduled[s].seq_id] for s in seq_index.tolist()],
                               dtype=np.int64)  # (P,) rows of the previous step's samples
        except Exception as e:
            failed: Future[T] = Future()
            failed.set_exception(e)
            return failed
        copy_ops = output.copy_ops
        model = self.model
        kv_cache = self.kv_cache
        # the KV tiers' gathers and scatters (before the window's: a block it seals now is
        # sealed before they run)
        tier_ops = (None if self.tiers is None
                    else self.tiers.take_ops(output.num_batched_tokens))
        window_ops = kv_cache.take_window_ops()  # int4: its fp16 window's slot moves and seals
        forward: Callable[..., Any] = (model.forward_device  # type: ignore[attr-defined]
                                       if getattr(model, "xp", np) is not np else model.forward)

        def device_work() -> T:
            model_fill = None
            if src is not None:
                assert prev is not None
                ids = prev.device_ids()  # the previous step's samples (stream order: done)
                batch.input_ids[pending] = 0  # any valid id: the model's device fills them in
                model_fill = InputFill(pending, ids[array_module(ids).asarray(src)])  # (P,)
            if window_ops is not None:  # int4: every step, its in-step seals replaced
                kv_cache.apply_window_ops(window_ops)
            if tier_ops is not None:
                tier_ops()
            if copy_ops:
                kv_cache.copy_blocks(copy_ops)
            if model_fill is None:
                return sample(forward(batch, kv_cache))
            return sample(forward(batch, kv_cache, fill=model_fill))
        return self.stream.submit(device_work)

"""The model runner: a SchedulerOutput -> one BatchInput -> forward -> logits of sampling rows."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.model import BatchInput
from kvcore.scheduler import SchedulerOutput


class Model(Protocol):
    def forward(self, batch: BatchInput, kv_cache: KVCache) -> np.ndarray: ...


class ModelRunner:
    """Runs the block copies, builds one BatchInput per step (one pass over the batch, one host
    array per field) and the forward pass. The SchedulerOutput is all it reads: only the
    sequences whose chunk reaches the end of their tokens want logits."""

    def __init__(self, model: Model, kv_cache: KVCache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size

    def execute(self, output: SchedulerOutput) -> tuple[Any, list[str]]:
        """Returns (logits (L, vocab) float32 on the model's device, the L sequence ids that
        sample, in row order). A model on a device (its `xp` is not NumPy) keeps its logits
        there through `forward_device` (CuPy on the GPU: the engine core samples them there);
        on the CPU `forward` gives host logits (or (L,) token ids, for models that sample
        themselves)."""
        if output.copy_ops:
            self.kv_cache.copy_blocks(output.copy_ops)
        scheduled = output.scheduled
        batch = BatchInput.build([s.token_ids for s in scheduled], [s.start for s in scheduled],
                                 [s.block_ids for s in scheduled], self.block_size,
                                 [s.sample for s in scheduled])
        sampling = [s.seq_id for s in scheduled if s.sample]
        model = self.model
        if getattr(model, "xp", np) is not np:  # a device model: its logits stay there
            return model.forward_device(batch, self.kv_cache), sampling  # type: ignore[attr-defined]
        return model.forward(batch, self.kv_cache), sampling

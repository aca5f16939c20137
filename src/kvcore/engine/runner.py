"""The model runner: SchedulerOutput -> BatchInput -> forward -> logits of the rows that sample."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvcore.cache import KVCacheManager
from kvcore.cache.kv_cache import KVCache
from kvcore.model import BatchInput
from kvcore.request import Request
from kvcore.scheduler import SchedulerOutput


class Model(Protocol):
    def forward(self, batch: BatchInput, kv_cache: KVCache) -> np.ndarray: ...


class ModelRunner:
    """Builds one BatchInput per step (one pass over the batch, one host array per field) and
    runs the forward pass. Only requests whose scheduled tokens reach the end of their token list
    want logits: a prefill chunk that stops short samples nothing."""

    def __init__(self, model: Model, kv_cache: KVCache, kv: KVCacheManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv

    def execute(self, output: SchedulerOutput,
                requests: dict[str, Request]) -> tuple[np.ndarray, list[Request]]:
        """Returns (logits (L, vocab) float32, the L requests that sample, in row order)."""
        if output.copy_ops:
            self.kv_cache.copy_blocks(output.copy_ops)
        token_ids: list[list[int]] = []
        num_computed: list[int] = []
        tables: list[list[int | None]] = []
        sample: list[bool] = []
        sampling: list[Request] = []
        block_table = self.kv.block_table
        for request_id, num_tokens in output.scheduled:
            request = requests[request_id]
            start = request.num_computed_tokens
            end = start + num_tokens
            token_ids.append(request.all_token_ids[start:end])
            num_computed.append(start)
            tables.append(block_table(request_id))
            wants = end == request.num_tokens
            sample.append(wants)
            if wants:
                sampling.append(request)
        batch = BatchInput.build(token_ids, num_computed, tables, self.kv.block_size, sample)
        return self.model.forward(batch, self.kv_cache), sampling

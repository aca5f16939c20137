"""A fake device for async-scheduling tests: its forward runs in a worker thread after a small
random delay, and its logits are a deterministic function of each row's whole token history,
which it reads back from the KV cache (each token's K slot holds its id). A pending token the
device was not given, a K/V slot written into the wrong block, a stale prefix-cache hit or a
block reused too early all change the logits, so outputs compared on and off catch them."""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from kvcore.config import ModelConfig
from kvcore.engine import Engine
from kvcore.engine.llm import engine_config
from kvcore.model import InputFill
from kvcore.model.tokenizer import Tokenizer

EOS_BIAS = 3.0  # makes EOS (id 2) likely enough that sequences stop by themselves
T = TypeVar("T")


class WorkerStream:
    """A device stream (kvcore.engine.runner.DeviceStream) whose work runs in one worker
    thread, FIFO, while the host goes on (also tools/bench_host_overhead.py's GPU-shaped mode)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcore-device")

    def submit(self, work: Callable[[], T]) -> Future[T]:
        return self._executor.submit(work)

    def close(self) -> None:
        self._executor.shutdown()


class HistoryModel:
    """`config` and `forward(batch, kv_cache)` like LlamaModel; `fail_calls`: forward calls
    (1-based) that raise instead; `order`: the logits depend on the last `order` tokens only
    (None: the whole history), so outputs repeat and speculative drafts get accepted."""

    def __init__(self, config: ModelConfig, max_delay_s: float = 0.002,
                 fail_calls: tuple[int, ...] = (), order: int | None = None) -> None:
        self.config = config
        self.order = order
        self.max_delay_s = max_delay_s
        self.fail_calls = fail_calls
        self.num_calls = 0
        self._delay = random.Random(0)  # the delays never change an output
        self._lock = threading.Lock()

    def forward(self, batch: Any, kv_cache: Any, fill: InputFill | None = None) -> np.ndarray:
        if fill is not None:  # pending tokens, from the step before's samples
            fill.apply(batch.input_ids)
        with self._lock:  # one device: two forwards never overlap
            self.num_calls += 1
            if self.num_calls in self.fail_calls:
                raise RuntimeError(f"injected forward failure (call {self.num_calls})")
            if self.max_delay_s:
                time.sleep(self._delay.uniform(0.0, self.max_delay_s))
            return self._logits(batch, kv_cache)

    def _logits(self, batch: Any, kv_cache: Any) -> np.ndarray:
        ids = batch.input_ids
        assert ids.min() >= 0, f"the device got a pending token: {ids.tolist()}"
        k = kv_cache.key_caches[0]  # (num_blocks, block_size, kv_heads, head_dim)
        bs = kv_cache.block_size
        slots = batch.slot_mapping
        k[slots // bs, slots % bs, 0, 0] = ids  # the "K/V" of a token: its id
        vocab = self.config.vocab_size
        out = np.empty((len(batch.logits_indices), vocab), dtype=np.float32)  # (L, V)
        rows_seq = np.searchsorted(batch.query_start_loc, batch.logits_indices, side="right") - 1
        for r, (row, s) in enumerate(zip(batch.logits_indices.tolist(), rows_seq.tolist(),
                                         strict=True)):
            positions = np.arange(int(batch.positions[row]) + 1)  # (p + 1,)
            if self.order is not None:
                positions = positions[-self.order:]
            history = k[batch.block_tables[s][positions // bs], positions % bs, 0, 0]
            seed = zlib.crc32(history.astype(np.int64).tobytes())
            out[r] = np.random.default_rng(seed).standard_normal(vocab) * 2.0
            out[r, 2] += EOS_BIAS
        return out


def fake_engine(model_dir: Path, async_scheduling: bool, worker: bool = True,
                fail_calls: tuple[int, ...] = (), max_delay_s: float = 0.002,
                order: int | None = None, **engine_args: Any) -> Engine:
    """An Engine over HistoryModel; `worker`: its device work runs in a worker thread."""
    engine_args.setdefault("block_size", 4)
    engine_args.setdefault("num_blocks", 512)
    config = engine_config(str(model_dir), async_scheduling=async_scheduling, device="cpu",
                           **engine_args)
    model = HistoryModel(ModelConfig.from_dir(model_dir), max_delay_s, fail_calls, order)
    engine = Engine(config, model=model, tokenizer=Tokenizer.from_dir(model_dir))
    if worker:
        engine.core.runner.stream = WorkerStream()
    return engine

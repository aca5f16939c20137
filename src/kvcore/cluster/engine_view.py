"""The one place the cluster reads below AsyncEngine's public surface (port it when AsyncEngine
grows read-only `tokenizer`, `model_config`, `max_model_len` and a stats snapshot).

Everything else in kvcore.cluster uses only `AsyncEngine.generate / abort / start / stop /
from_config` and the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcore.cache import CacheEvent
from kvcore.config import EngineConfig, ModelConfig
from kvcore.engine import AsyncEngine, EngineStats
from kvcore.engine.setup import engine_max_model_len
from kvcore.model.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the ingress must agree on with every replica (the router's hashes depend on it)."""

    block_size: int
    max_model_len: int
    vocab_size: int
    prefix_caching: bool


def enable_cache_events(engine: AsyncEngine) -> None:
    """Start recording the pool's prefix-cache changes (before the first request)."""
    engine.engine.kv.pool.enable_events()


def drain_cache_events(engine: AsyncEngine) -> list[CacheEvent]:
    """The pool's cache changes since the last drain (thread-safe against a running step)."""
    return engine.engine.kv.pool.drain_events()


def engine_stats(engine: AsyncEngine) -> EngineStats:
    """A snapshot of counters and gauges; read on the event loop while a step may run, which
    only ever sees a length or a counter one step old."""
    return engine.engine.stats()


def replica_info(engine: AsyncEngine) -> ReplicaInfo:
    core = engine.engine
    return ReplicaInfo(block_size=core.kv.block_size, max_model_len=core.max_model_len,
                       vocab_size=core.model_config.vocab_size,
                       prefix_caching=core.kv.enable_prefix_caching)


class IngressModel:
    """The model facts the OpenAI routes read (`tokenizer`, `model_config`, `max_model_len`,
    `config`, `stats()`), loaded without weights: the ingress tokenizes, replicas compute.
    Shaped like Engine because the service reads `async_engine.engine.<field>` today."""

    def __init__(self, config: EngineConfig, info: ReplicaInfo, stats: Any) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.model_config = ModelConfig.from_dir(config.model)
        self.max_model_len = min(info.max_model_len,
                                 engine_max_model_len(config, self.model_config))
        self.info = info
        self._stats = stats  # () -> EngineStats | None: the replicas' reports, summed

    def stats(self) -> EngineStats | None:
        return self._stats()

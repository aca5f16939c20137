"""What the ingress knows of the replicas' engine: the facts every replica must agree on, and the
model facts the ingress serves (tokenizer, config) loaded without weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


def replica_info(engine: AsyncEngine) -> ReplicaInfo:
    return ReplicaInfo(block_size=engine.stats().block_size, max_model_len=engine.max_model_len,
                       vocab_size=engine.model_config.vocab_size,
                       prefix_caching=engine.config.cache.enable_prefix_caching)


class IngressModel:
    """The model facts ClusterEngine serves (`tokenizer`, `model_config`, `max_model_len`,
    `stats()`), loaded without weights: the ingress tokenizes, replicas compute."""

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

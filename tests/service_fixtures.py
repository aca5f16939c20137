"""Builders shared by the service tests: a tiny-model AsyncEngine and its app."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.engine import AsyncEngine, Engine
from kvcore.service import STATE_KEY, make_app

MODEL_NAME = "tiny"


def tiny_config(model_dir: Path, *, num_blocks: int = 96, max_model_len: int = 128,
                enable_prefix_caching: bool = True, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 64) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu",
                        cache=CacheConfig(block_size=4, num_blocks=num_blocks,
                                          enable_prefix_caching=enable_prefix_caching),
                        scheduler=SchedulerConfig(max_model_len=max_model_len,
                                                  max_num_batched_tokens=max_num_batched_tokens,
                                                  max_num_seqs=max_num_seqs))


def tiny_app(model_dir: Path, engine_kwargs: dict[str, Any] | None = None,
             **app_kwargs: Any) -> web.Application:
    engine = AsyncEngine(Engine(tiny_config(model_dir, **(engine_kwargs or {}))))
    app_kwargs.setdefault("served_model_name", MODEL_NAME)
    return make_app(engine, **app_kwargs)


def engine_of(app: web.Application) -> Engine:
    engine = app[STATE_KEY].engine
    assert engine is not None
    return engine.engine


async def wait_pool_idle(app: web.Application, timeout: float = 10.0) -> None:
    """Until no sequence holds a block (aborts land within a step), or AssertionError."""
    engine = engine_of(app)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        stats = engine.stats()
        if stats.kv_cache_usage == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"pool still in use: {stats}")
        await asyncio.sleep(0.02)

"""The engine layer: Engine (one step at a time), LLM (offline batches), AsyncEngine (asyncio)."""

import kvcore.logs  # noqa: F401  (kvcore writes no log line unless the program configures it)
from kvcore.engine.async_engine import AsyncEngine, RequestFailed
from kvcore.engine.client import EngineClient
from kvcore.engine.engine import Engine, EngineStats
from kvcore.engine.llm import LLM
from kvcore.engine.setup import check_prompt

__all__ = ["LLM", "AsyncEngine", "Engine", "EngineClient", "EngineStats", "RequestFailed",
           "check_prompt"]

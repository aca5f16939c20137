"""The engine layer: Engine (one step at a time), LLM (offline batches), AsyncEngine (asyncio)."""

from kvcore.engine.async_engine import AsyncEngine, RequestFailed
from kvcore.engine.engine import Engine, EngineStats
from kvcore.engine.llm import LLM

__all__ = ["LLM", "AsyncEngine", "Engine", "EngineStats", "RequestFailed"]

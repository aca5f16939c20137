"""The engine layer: Engine (one step at a time), LLM (offline batches), AsyncEngine (asyncio)."""

from kvcore.engine.engine import Engine, EngineStats

__all__ = ["Engine", "EngineStats"]

"""kvcore: a framework-free LLM inference runtime."""

__version__ = "0.1.0"

"""The OpenAI-compatible aiohttp application, installed as kvcore.service."""

"""The OpenAI-compatible aiohttp application, installed as kvcore.service."""

from kvcore.service.app import drain, make_app
from kvcore.service.state import STATE_KEY, ServiceState

__all__ = ["STATE_KEY", "ServiceState", "drain", "make_app"]

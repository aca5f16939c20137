"""A kvcore.service app served on loopback from a background thread, for synchronous clients."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web


class LiveServer:
    """The app on 127.0.0.1 and a free port, on its own event loop in a daemon thread."""

    def __init__(self, make: Callable[[], web.Application]) -> None:
        self._make = make
        self.loop = asyncio.new_event_loop()
        self.app: web.Application | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.app = self._make()
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (to read engine state) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the live server did not start")
        return self

    def stop(self) -> None:
        assert self._runner is not None
        self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


@contextmanager
def live_server(make: Callable[[], web.Application]) -> Iterator[LiveServer]:
    server = LiveServer(make).start()
    try:
        yield server
    finally:
        server.stop()

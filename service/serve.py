"""The aiohttp serve loop both CLIs run (one engine, or a cluster of replicas): listen, wait for
SIGTERM/SIGINT, drain."""

from __future__ import annotations

import asyncio
import signal

import structlog
from aiohttp import web

from kvcore.service.app import drain
from kvcore.service.edge import Edge
from kvcore.service.state import FAILED, LOADING, STATE_KEY

log = structlog.get_logger("kvcore.serve")


async def _exit_on_load_failure(app: web.Application, stop: asyncio.Event) -> None:
    state = app[STATE_KEY]
    while state.status == LOADING:
        await asyncio.sleep(0.1)
    if state.status == FAILED:
        stop.set()


async def serve(app: web.Application, host: str, port: int, drain_timeout: float,
                edge: Edge | None = None) -> int:
    """Run until SIGTERM/SIGINT, then drain: 503 to new requests, finish or abort the rest.

    Returns the exit status: 0 after a drain, 1 when the model failed to load.
    """
    edge = edge or Edge()
    edge.install(app)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # engine requests at once (no polling)
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                           **edge.handler_args)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(edge.protocol_factory(runner), host, port)
    bound = server.sockets[0].getsockname()[1]  # the port, when 0 asked for any free one
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("serving", url=f"http://{host}:{bound}", port=bound)
    watcher = asyncio.create_task(_exit_on_load_failure(app, stop))
    try:
        await stop.wait()
        if app[STATE_KEY].status == FAILED:
            return 1
        log.info("draining", timeout_s=drain_timeout)
        aborted = await drain(app, drain_timeout)
        log.info("drained", aborted=aborted)
        return 0
    finally:
        watcher.cancel()
        server.close()
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

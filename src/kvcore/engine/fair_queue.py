"""Turns at a few request-sized workers (the service's tokenizing threads, the constraint
compile workers), taken round-robin among the tenants that wait.

A tenant alone may use every worker; once another tenant waits, each freed worker goes to the
next tenant in turn, so one tenant's queue of big tokenizations or compiles delays another's
by one task at most, not by the whole queue. (A per-tenant in-flight cap would do the same but
idle workers while a tenant is alone, and without API keys every client is the one anonymous
tenant.)
"""

from __future__ import annotations

import asyncio
from collections import deque


class FairQueue:
    """`num_slots` turns; use on the event loop only: `await acquire(tenant)`, then `release()`."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_free = num_slots
        # tenants with callers waiting, in turn order (a served tenant goes to the back)
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    async def acquire(self, tenant: str) -> None:
        if self.num_free > 0 and not self._waiting:
            self.num_free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # the turn came with the cancellation: pass it on
            else:
                queue = self._waiting.get(tenant)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[tenant]
            raise

    def release(self) -> None:
        """Hand the freed turn to the first waiting tenant, which then goes to the back."""
        while self._waiting:
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            turn = queue.popleft()
            if queue:
                self._waiting[tenant] = queue
            if not turn.done():
                turn.set_result(None)
                return
        self.num_free += 1

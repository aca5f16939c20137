"""N1: --max-waiting holds under a burst of concurrent calls: each admitted call reserves its
sequences before any await, so calls arriving together see each other."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from kvcore.service import STATE_KEY
from kvcore.service.admission import Admission
from kvcore.service.errors import APIError
from service_fixtures import engine_of, tiny_app, wait_pool_idle

MAX_WAITING, MAX_NUM_SEQS, N = 4, 4, 4


class _Stats:
    def __init__(self, num_running: int) -> None:
        self.num_running = num_running


class _Engine:
    """What Admission reads of an engine: its waiting count and its running sequences."""

    def __init__(self, num_waiting: int = 0, num_running: int = 0) -> None:
        self.num_waiting = num_waiting
        self._stats = _Stats(num_running)

    def stats(self) -> _Stats:
        return self._stats


def test_reservations_count_until_released() -> None:
    admission = Admission(max_waiting=4)
    engine = _Engine()
    first = admission.admit(engine, 3)  # nothing waits, nothing runs: 3 of 4
    with pytest.raises(APIError) as err:
        admission.admit(engine, 2)  # 3 reserved, not yet run, + 2 > 4
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    engine._stats.num_running = 3  # the engine runs them: they no longer wait
    second = admission.admit(engine, 4)
    assert admission.num_reserved == 7 and admission.num_waiting(engine) == 4
    second.release(1)
    second.close()
    second.close()  # idempotent: never released twice
    first.close()
    assert admission.num_reserved == 0
    assert Admission(None).admit(_Engine(num_waiting=100), 9).num_seqs == 9  # no limit
    big = Admission(max_waiting=2).admit(engine, 5)  # bigger than the queue, into an empty one
    assert big.num_seqs == 5
    with pytest.raises(ValueError, match="max_waiting"):
        Admission(-1)


def _slow_forward(app: Any) -> None:
    model = engine_of(app).core.runner.model
    real = model.forward

    def slow(*args: Any) -> Any:  # so no admitted call ends while the burst arrives
        time.sleep(0.02)
        return real(*args)

    model.forward = slow  # type: ignore[method-assign]


@pytest.mark.asyncio
async def test_a_burst_never_admits_more_than_the_limit_plus_what_can_run(
        aiohttp_client: Any, tiny_model_dir: Any) -> None:
    app = tiny_app(tiny_model_dir, max_waiting=MAX_WAITING,
                   engine_kwargs={"max_num_seqs": MAX_NUM_SEQS})
    _slow_forward(app)
    client: TestClient = await aiohttp_client(app)
    body = {"prompt": "a", "max_tokens": 40, "ignore_eos": True, "n": N}
    responses = await asyncio.gather(*(client.post("/v1/completions", json=body)
                                       for _ in range(40)))
    statuses = sorted(r.status for r in responses)
    admitted = statuses.count(200)
    assert set(statuses) == {200, 429}, statuses
    # each admitted call holds N sequences until it ends, and none ended during the burst
    assert 1 <= admitted * N <= MAX_WAITING + MAX_NUM_SEQS, statuses
    assert app[STATE_KEY].admission.num_reserved == 0  # every call gave its sequences back
    await wait_pool_idle(app)

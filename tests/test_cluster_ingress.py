"""ClusterEngine over a fake DeploymentHandle: routing bookkeeping, cache reports, abort, a dead
replica (no Ray cluster; only Ray's exception types)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.exceptions import RequestCancelledError  # noqa: E402

from kvcore.cache import chain_hashes  # noqa: E402
from kvcore.cluster.engine_view import IngressModel, ReplicaInfo  # noqa: E402
from kvcore.cluster.ingress import ClusterEngine  # noqa: E402
from kvcore.cluster.policy import RoutingPolicy  # noqa: E402
from kvcore.cluster.state import ReplicaReport, Route, RouterState  # noqa: E402
from kvcore.config import EngineConfig  # noqa: E402
from kvcore.engine import EngineStats, RequestFailed  # noqa: E402
from kvcore.request import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from kvcore.sampling import SamplingParams  # noqa: E402

BS = 4
STATS = EngineStats(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_free_blocks=9,
                    num_blocks=10, prefix_cache_queries=0, prefix_cache_hits=0,
                    num_preemptions=0, block_size=BS, cache_dtype="fp32")


def _output(request_id: str, prompt: list[int], tokens: list[int], finished: bool,
            cached: int) -> RequestOutput:
    return RequestOutput(request_id, None, prompt, [CompletionOutput(  # tokens: the new ones
        0, "", list(tokens), None, None, "length" if finished else None, None)], finished, cached,
        RequestMetrics(arrival_time=0.0))


class FakeStream:
    """A DeploymentResponseGenerator: yields the script's items, honours cancel()."""

    def __init__(self, items: list[Any], fail: BaseException | None, hang: bool) -> None:
        self._items, self._fail, self._hang = items, fail, hang
        self.cancelled = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def _gen(self) -> AsyncIterator[Any]:
        for item in self._items:
            if self.cancelled.is_set():
                raise RequestCancelledError("x")
            yield item
            await asyncio.sleep(0)
        if self._fail is not None:
            raise self._fail
        if self._hang:
            await self.cancelled.wait()
            raise RequestCancelledError("x")

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._gen()


class FakeCall:
    """A unary method of the handle: `.remote(**kwargs)` is awaitable, like a
    DeploymentResponse; `answer(**kwargs)` is what the replica returns."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, **kwargs: Any) -> Any:
        async def reply() -> Any:
            return self.answer(**kwargs)
        return reply()


class FakeHandle:
    """Routes like Ray would: asks the RouterState (as KVCacheRequestRouter does), then streams
    a scripted answer from the chosen replica."""

    def __init__(self, state: RouterState, replicas: list[str]) -> None:
        self.state, self.replicas = state, replicas
        self.script: dict[str, Any] = {}
        self.streams: list[FakeStream] = []

    def options(self, **_: Any) -> FakeHandle:
        return self

    @property
    def generate(self) -> FakeHandle:
        return self

    @property
    def kv_snapshot(self) -> FakeCall:
        return FakeCall(lambda target_replica: {
            "requests": [{"group": "a"}],
            "pool": {"num_blocks": 10, "replica": target_replica}})

    def remote(self, prompt: list[int], params: Any, request_id: str, priority: int,
               salt: str | None, route: Route) -> FakeStream:
        replica = self.state.route(route, self.replicas).replica_id
        fail, hang, cached = self.script.get(request_id, (None, False, 0))
        events = tuple((True, h) for h in chain_hashes(prompt, BS, salt))
        items = [(_output(request_id, prompt, [7], False, cached),
                  ReplicaReport(replica, 1, events, STATS))]
        if fail is None and not hang:
            items.append((_output(request_id, prompt, [8], True, cached),
                          ReplicaReport(replica, 1, (), STATS)))
        stream = FakeStream(items, fail, hang)
        self.streams.append(stream)
        return stream


@pytest.fixture
def engine(tiny_model_dir: Path) -> tuple[ClusterEngine, FakeHandle, RouterState]:
    state = RouterState(RoutingPolicy("prefix", rng=random.Random(0)))
    handle = FakeHandle(state, ["r1", "r2"])
    model = IngressModel(EngineConfig(model=str(tiny_model_dir), device="cpu"),
                         ReplicaInfo(block_size=BS, max_model_len=64, vocab_size=259,
                                     prefix_caching=True), lambda: None)
    return ClusterEngine(handle, state, model), handle, state


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _collect(engine: ClusterEngine, request_id: str, prompt: list[int]) -> list[Any]:
    return [o async for o in engine.generate(prompt, SamplingParams(max_tokens=2), request_id,
                                             cache_salt="tenant")]


def test_requests_follow_their_prefix_and_counts_return_to_zero(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    async def main() -> None:
        ce, handle, state = engine
        await ce.start()
        prompt = list(range(10, 23))  # 3 full blocks of 4 + 1: the last token is never a hit
        handle.script["b"] = (None, False, 12)
        outs = [await _collect(ce, rid, prompt) for rid in ("a", "b")]
        assert all(o[-1].finished for o in outs)
        snap = state.snapshot()
        first = next(r for r, s in snap.items() if s.routed)
        assert snap[first].routed == 2  # "b" followed "a" to the replica holding its chain
        assert state.decisions["prefix"] == 1
        assert (snap[first].predicted_tokens, snap[first].cached_tokens) == (12, 12)
        assert all(s.num_outstanding == 0 for s in snap.values())
        assert ce.stats() is not None and ce.num_waiting == 0
    _run(main())


def test_abort_ends_the_stream_with_finish_reason_abort(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    async def main() -> None:
        ce, handle, state = engine
        await ce.start()
        handle.script["slow"] = (None, True, 0)
        gen = ce.generate(list(range(30, 40)), SamplingParams(max_tokens=5), "slow")
        first = await gen.__anext__()
        assert not first.finished
        await ce.abort("slow")
        last = await gen.__anext__()
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert last.outputs[0].token_ids == []  # nothing new: only the finish
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()
        assert handle.streams[-1].cancelled.is_set()
        assert all(s.num_outstanding == 0 for s in state.snapshot().values())
    _run(main())


def test_a_dead_replica_fails_only_its_request(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    async def main() -> None:
        ce, handle, state = engine
        await ce.start()
        handle.script["doomed"] = (ActorDiedError(), False, 0)
        with pytest.raises(RequestFailed, match="replica"):
            await _collect(ce, "doomed", list(range(50, 60)))
        assert (await _collect(ce, "fine", list(range(60, 70))))[-1].finished
        state.sync_replicas(["r2"])  # Ray reports r1 gone: its chains leave the index
        assert "r1" not in state.index.replicas() and "r1" not in state.replicas
    _run(main())


def test_another_tenants_request_is_not_routed_by_affinity(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    async def main() -> None:
        ce, _, state = engine
        await ce.start()
        prompt = list(range(10, 23))
        params = SamplingParams(max_tokens=2)
        _ = [o async for o in ce.generate(prompt, params, "a", cache_salt="salt-a")]
        _ = [o async for o in ce.generate(prompt, params, "b", cache_salt="salt-b")]
        _ = [o async for o in ce.generate(prompt, params, "c", cache_salt="salt-a")]
        assert state.decisions == {"fallback-miss": 2, "prefix": 1}
    _run(main())


def test_the_ingress_counts_routed_sequences_until_their_streams_end(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    """N1 under replicas: the waiting count is the ingress's own (sequences routed and not yet
    finished, per replica) less what each replica reports running, not the reports alone
    (which say nothing of the requests still on their way)."""
    async def main() -> None:
        ce, handle, state = engine
        await ce.start()
        ids = ["a", "b", "c"]
        for rid in ids:
            handle.script[rid] = (None, True, 0)  # they run until aborted
        gens = [ce.generate(list(range(10 * i + 100, 10 * i + 109)),
                            SamplingParams(n=3, max_tokens=5), rid) for i, rid in enumerate(ids)]
        for gen in gens:
            await gen.__anext__()  # routed; its replica's report: 1 running, 0 waiting
        snap = state.snapshot()
        assert sum(r.num_seqs for r in snap.values()) == 9
        busy = [r for r in snap.values() if r.num_seqs]
        assert ce.num_waiting == 9 - len(busy) >= 7  # the reports alone say 0
        for gen, rid in zip(gens, ids, strict=True):
            await ce.abort(rid)
            _ = [o async for o in gen]
        assert ce.num_waiting == 0
        assert all(r.num_seqs == 0 and r.num_outstanding == 0
                   for r in state.snapshot().values())
        assert ce.replica_ids() == ["r1", "r2"] or set(ce.replica_ids()) <= {"r1", "r2"}
    _run(main())


def test_debug_kv_answers_over_replicas_with_an_admin_key(
        engine: tuple[ClusterEngine, FakeHandle, RouterState]) -> None:
    """The service's /debug/kv on a ClusterEngine (kvcore serve --replicas 2 --admin-key): 200,
    the snapshot of the replica asked for, never a 5xx."""
    from aiohttp.test_utils import TestClient, TestServer

    from kvcore.service import make_app

    async def main() -> None:
        ce, _, _ = engine
        app = make_app(ce, served_model_name="m", admin_keys=["adm"])
        async with TestClient(TestServer(app)) as client:
            auth = {"Authorization": "Bearer adm"}
            response = await client.get("/debug/kv", headers=auth)
            assert response.status == 503  # no replica has reported yet: retry, not a 500
            _ = [o async for o in ce.generate(list(range(10, 19)), SamplingParams(max_tokens=2),
                                              "a")]
            for replica in ce.replica_ids():
                response = await client.get("/debug/kv", params={"replica": replica},
                                            headers=auth)
                assert response.status == 200, await response.text()
                body = await response.json()
                assert body["replica"] == replica and body["requests"] == [{"group": "a"}]
                assert body["pool"] == {"num_blocks": 10, "replica": replica}
            assert (await client.get("/debug/kv")).status == 401
    _run(main())

"""Constraints cannot hurt the server: the crash shapes at 10x the lengths that killed it are
400s and it keeps serving; unsatisfiable, mistyped, oversized and invalid-Unicode constraints
are 400s naming the field; compiles run only on compile threads (never on the event loop or in
the engine step); a plain stream's gaps stay bounded while large grammars arrive; and the
server's memory stays flat across unique large schemas."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcore.grammar.cache import CompiledCache
from kvcore.service import STATE_KEY
from service_fixtures import tiny_app

sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
import soak_constraints as shapes  # noqa: E402

ENGINE = {"max_model_len": 1024, "num_blocks": 1024, "max_num_batched_tokens": 256}
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def app(tiny_model_dir: Path) -> Any:
    # bodies up to 8 MiB: the 10x shapes (1-2 MB of JSON) reach the constraint checks
    return tiny_app(tiny_model_dir, ENGINE, max_body_size=8 << 20)


def _compiler(app: Any) -> Any:
    return app[STATE_KEY].engine.engine.constraints


def _spy_compile_threads(app: Any) -> list[str]:
    """The thread of each compile the engine runs (pool check + native build)."""
    compiler = _compiler(app)
    names: list[str] = []
    real = compiler._compile

    def compile_(*args: Any) -> Any:
        names.append(threading.current_thread().name)
        return real(*args)

    compiler._compile = compile_
    return names


async def _chat(client: Any, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    resp = await client.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 4, **fields})
    return resp.status, await resp.json()


@pytest.mark.asyncio
async def test_crash_shapes_at_10x_are_400s_and_the_server_keeps_serving(
        aiohttp_client: Any, app: Any) -> None:
    client = await aiohttp_client(app)
    threads = _spy_compile_threads(app)
    for scale in (1, 10):
        for name, fields, param in shapes.crash_cases(scale):
            status, body = await _chat(client, fields)
            assert status == 400 and body["error"]["param"] == param, (name, scale, body)
            status, body = await _chat(client, {})  # alive: a plain request right after
            assert status == 200 and body["choices"][0]["finish_reason"], body
    status, _ = await _chat(client, {"response_format": shapes.schema_format(
        shapes.schema_chain(100))})  # a chain inside the bounds compiles and runs
    assert status == 200
    assert threads and all(t.startswith("kvcore-compile") for t in threads), threads
    assert _compiler(app).pool.stats.num_crashes == 0


@pytest.mark.asyncio
async def test_s3_s4_s6_are_400s_naming_the_field(aiohttp_client: Any, app: Any) -> None:
    client = await aiohttp_client(app)
    for name, fields, param in shapes.error_cases():
        status, body = await _chat(client, fields)
        assert status == 400 and body["error"]["param"] == param, (name, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body = await _chat(client, shapes.error_cases()[-1][1] | {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "f", "arguments": '{"ok": "\\u00e9"}'}}]},
        {"role": "user", "content": "go on"}]})
    assert status == 200, body  # a valid escape in the arguments is fine
    status, body = await _chat(client, {"tools": [{"type": "function", "function": {
        "name": "f", "strict": "yes", "parameters": {"type": "object"}}}]})
    assert status == 400 and body["error"]["param"] == "tools[0].function.strict"


async def _stream_times(client: Any, body: dict[str, Any], times: list[float]) -> None:
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    assert resp.status == 200
    async for line in resp.content:
        if line.startswith(b"data: {"):
            times.append(time.monotonic())


@pytest.mark.asyncio
async def test_a_plain_streams_gaps_stay_bounded_while_large_grammars_arrive(
        aiohttp_client: Any, app: Any) -> None:
    """Two unique 20,000-way alternations (~0.2-0.5 s of compile each), three regexes that
    stall backtracking engines and a 100-property schema arrive during a 600-token stream.
    Compiling on the event loop made a gap of the compile's length per grammar (1.5-2.5 s in
    the issue's probes); here the gaps stay within 2x the longest alone or while the same
    requests arrive compiled already (their bodies and steps, not their compiles), or alone +
    0.25 s on a noisy 2-core machine where the gaps alone are milliseconds (measured again once
    when a gap passes: a shared machine's hiccup rarely repeats, a compile on the loop does)."""
    client = await aiohttp_client(app)

    async def post(body: dict[str, Any]) -> tuple[int, bytes]:
        resp = await client.post("/v1/completions", json={"prompt": "x", **body})
        return resp.status, await resp.read()

    async def stream(body: dict[str, Any], times: list[float]) -> None:
        await _stream_times(client, body, times)

    plain = {"prompt": "hello", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    await stream({**plain, "max_tokens": 8}, [])  # warm-up
    await post({"structured_outputs": {"regex": "warm"}, "max_tokens": 1})  # workers started
    report = await shapes.checked_stall_probe(post, stream, plain, 2, f"t{os.getpid()}")
    print("stall probe:", report)
    assert report["grammar_statuses"] == [200] * 6, report
    assert report["verdict"]["ok"], report


@pytest.mark.asyncio
async def test_the_stall_probe_catches_a_compile_on_the_event_loop(aiohttp_client: Any,
                                                                 app: Any) -> None:
    """The check above can fail: with prepare compiling on the event loop (as check_request
    once did), the probe's verdict is a stall."""
    engine = app[STATE_KEY].engine

    async def on_the_loop(constraint: Any, tenant: str = "default",
                          cache_salt: str | None = None) -> Any:
        if constraint is None:
            return None
        return engine.engine.constraints._compile(constraint, tenant, cache_salt)

    engine.prepare = on_the_loop
    client = await aiohttp_client(app)

    async def post(body: dict[str, Any]) -> tuple[int, bytes]:
        resp = await client.post("/v1/completions", json={"prompt": "x", **body})
        return resp.status, await resp.read()

    async def stream(body: dict[str, Any], times: list[float]) -> None:
        await _stream_times(client, body, times)

    plain = {"prompt": "hello", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    await post({"structured_outputs": {"regex": "warm"}, "max_tokens": 1})
    report = await shapes.stall_probe(post, stream, plain, 2, f"loop{os.getpid()}")
    verdict = shapes.stall_verdict(report)
    assert not verdict["ok"] and report["with_grammars"]["max_s"] > 0.3, (verdict, report)


def _rss() -> int:
    return shapes.rss_bytes(os.getpid())


@pytest.mark.asyncio
async def test_rss_stays_flat_across_unique_large_schemas(aiohttp_client: Any,
                                                          app: Any) -> None:
    """40 unique ~220 KB enum schemas (~5 MB compiled each: 200 MB if all were kept) through a
    32 MiB cache: the compiled bytes stay within the budget and the server's RSS grows by
    less than 64 MiB after the first ten."""
    _compiler(app).cache = CompiledCache(32 << 20, tenant_share=0.5)
    client = await aiohttp_client(app)

    async def post(body: dict[str, Any]) -> tuple[int, bytes]:
        resp = await client.post("/v1/completions", json={"prompt": "x", **body})
        return resp.status, await resp.read()

    report = await shapes.memory_loop(post, _rss, 40, f"m{os.getpid()}")
    await asyncio.sleep(0)
    print("memory loop:", report)
    cache = _compiler(app).cache
    assert report["statuses"] == {"200": 40}, report
    assert cache.num_bytes <= 16 << 20 and cache.num_evictions > 0  # one tenant: half
    assert report["growth_after_warm_mb"] < 64, report

"""Tenant-isolated prefix caching, abort on disconnect (blocks return to the pool), request logs."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from service_fixtures import engine_of, tiny_app, wait_pool_idle

pytestmark = pytest.mark.asyncio

PROMPT = "the quick brown fox jumps over the lazy dog, twice over"
LONG = {"engine_kwargs": {"max_model_len": 1024, "num_blocks": 600}}


async def _cached(client, key: str, salt: str | None = None) -> int:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    resp = await client.post("/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"})
    assert resp.status == 200, await resp.text()
    return (await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_tenants_never_share_and_salt_only_narrows(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir,
                                           api_keys={"ka": "A", "ka2": "A", "kb": "B"}))
    assert await _cached(client, "ka") == 0
    hits = await _cached(client, "ka")
    assert hits >= 8 and hits % 4 == 0  # full blocks of 4 tokens
    assert await _cached(client, "ka2") == hits  # another key of the same tenant shares
    assert await _cached(client, "kb") == 0  # tenant B: identical prompt, no hit
    assert await _cached(client, "kb") == hits
    # a request salt narrows within the tenant; copying it does not reach the other tenant
    assert await _cached(client, "ka", salt="s1") == 0
    assert await _cached(client, "ka", salt="s1") == hits
    assert await _cached(client, "kb", salt="s1") == 0


async def _abort_count(client) -> float:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith("kvcore:request_success_total") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_stream_disconnect_aborts_and_frees_blocks(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, **LONG))
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True, "n": 2}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")
    resp.close()  # the client goes away mid-stream
    await wait_pool_idle(client.server.app)
    assert await _abort_count(client) == 2  # both choices ended as aborted


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_non_stream_disconnect_aborts(aiohttp_client, tiny_model_dir, path: str) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, **LONG))
    body = {"max_tokens": 900, "ignore_eos": True}
    body |= ({"prompt": PROMPT} if path == "/v1/completions"
             else {"messages": [{"role": "user", "content": PROMPT}]})
    pending = asyncio.create_task(client.post(path, json=body))
    await asyncio.sleep(0.3)
    pending.cancel()  # closes the connection before any byte of the answer
    with pytest.raises(asyncio.CancelledError):
        await pending
    await wait_pool_idle(client.server.app)
    assert await _abort_count(client) == 1


async def test_disconnect_during_prefill_aborts(aiohttp_client, tiny_model_dir) -> None:
    # a 4-token budget per step: the 1,000-token prompt takes 250 prefill chunks
    app = tiny_app(tiny_model_dir, engine_kwargs={"max_model_len": 1024, "num_blocks": 600,
                                                  "max_num_batched_tokens": 4})
    client = await aiohttp_client(app)
    pending = asyncio.create_task(client.post("/v1/completions", json={
        "prompt": [7] * 1000, "max_tokens": 2, "stream": True}))
    engine = engine_of(app)
    while engine.stats().num_running == 0:
        await asyncio.sleep(0.001)
    pending.cancel()  # no token yet: the request is between prefill chunks
    with pytest.raises(asyncio.CancelledError):
        await pending
    await wait_pool_idle(app)
    metrics = await (await client.get("/metrics")).text()
    assert 'kvcore:generation_tokens_total{model_name="tiny"} 0.0' in metrics
    assert await _abort_count(client) == 1


async def test_one_log_line_per_request(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, api_keys={"ka": "A"}))
    with structlog.testing.capture_logs() as logs:
        resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                          "user": "u1"},
                                 headers={"Authorization": "Bearer ka"})
        body = await resp.json()
    lines = [e for e in logs if e["event"] == "request"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == body["id"] and line["tenant"] == "A" and line["user"] == "u1"
    assert line["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == 3 and line["cached_tokens"] == 0
    assert line["ttft_s"] > 0 and line["finish_reason"] == [body["choices"][0]["finish_reason"]]

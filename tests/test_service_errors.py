"""Errors and limits over HTTP: 400/401/404/405/413/429/503 in the OpenAI shape, never a 500."""

from __future__ import annotations

import asyncio
import threading

import pytest
import pytest_asyncio

from kvcore.engine import AsyncEngine, Engine
from kvcore.service import STATE_KEY, drain, make_app
from service_fixtures import MODEL_NAME, tiny_app, tiny_config

pytestmark = pytest.mark.asyncio


def assert_error(body: dict, status: int, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] in (status, "invalid_api_key", "model_not_found")
    if param is not None:
        assert error["param"] == param


@pytest_asyncio.fixture
async def client(aiohttp_client, tiny_model_dir):
    return await aiohttp_client(tiny_app(tiny_model_dir, max_body_size=4096))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 10**100}, "n"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 500}, "max_tokens"),
    ("/v1/completions", {"prompt": [7] * 128}, "prompt"),
    # against the vocabulary: the engine's check, once
    ("/v1/completions", {"prompt": [10**6]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1000000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"1": "x"}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "top_p": -5}, "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}] * 0}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
async def test_400_names_the_param(client, path: str, body: dict, param: str) -> None:
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert_error(await resp.json(), 400, param)


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 100000,
                                 b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}"])
async def test_malformed_bodies_are_400(client, raw: bytes) -> None:
    resp = await client.post("/v1/completions", data=raw,
                             headers={"Content-Type": "application/json"})
    assert resp.status in (400, 413)
    assert_error(await resp.json(), resp.status)


async def test_404_405_413(client) -> None:
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert_error(await resp.json(), 404)
    resp = await client.post("/v1/completions", json={"model": "other", "prompt": "a"})
    assert resp.status == 404 and (await resp.json())["error"]["param"] == "model"
    resp = await client.get("/v1/completions")
    assert resp.status == 405
    assert_error(await resp.json(), 405)
    resp = await client.post("/v1/completions", json={"prompt": "a" * 5000})
    assert resp.status == 413
    assert_error(await resp.json(), 413)


async def test_429_when_waiting_queue_full(aiohttp_client, tiny_model_dir) -> None:
    # one running sequence at most, one waiting request at most
    app = tiny_app(tiny_model_dir, max_waiting=1, engine_kwargs={"max_num_seqs": 1})
    client = await aiohttp_client(app)
    long = {"prompt": "a", "max_tokens": 100, "ignore_eos": True}
    running = await client.post("/v1/completions", json=long | {"stream": True})
    assert running.status == 200  # headers come with its first token: it runs
    waiting = asyncio.create_task(client.post("/v1/completions", json=long))
    async_engine = app[STATE_KEY].engine
    assert async_engine is not None
    while async_engine.num_waiting < 1:
        await asyncio.sleep(0.005)
    resp = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
    assert resp.status == 429 and resp.headers["Retry-After"] == "1"
    assert_error(await resp.json(), 429)
    assert (await running.text()).endswith("data: [DONE]\n\n")
    assert (await waiting).status == 200
    resp = await client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
    assert resp.status == 200


async def test_401_and_public_health(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, api_keys=["k1"]))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
        resp = await client.post("/v1/completions", json={"prompt": "a"}, headers=headers)
        assert resp.status == 401
        assert_error(await resp.json(), 401)
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/health")).status == 200
    assert (await client.get("/metrics")).status == 200
    resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2},
                             headers={"Authorization": "Bearer k1"})
    assert resp.status == 200


async def test_503_while_loading_then_ready(aiohttp_client, tiny_model_dir) -> None:
    release = threading.Event()

    def build() -> AsyncEngine:
        release.wait(30)
        return AsyncEngine(Engine(tiny_config(tiny_model_dir)))

    client = await aiohttp_client(make_app(build, served_model_name=MODEL_NAME))
    assert (await client.get("/health")).status == 503
    resp = await client.post("/v1/completions", json={"prompt": "a"})
    assert resp.status == 503
    assert_error(await resp.json(), 503)
    release.set()
    for _ in range(500):
        if (await client.get("/health")).status == 200:
            break
        await asyncio.sleep(0.02)
    resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert resp.status == 200


async def test_drain_finishes_in_flight_then_503(client) -> None:
    body = {"prompt": "drain", "max_tokens": 20, "ignore_eos": True}
    in_flight = asyncio.create_task(client.post("/v1/completions", json=body))
    await asyncio.sleep(0.05)
    assert await drain(client.server.app, timeout=30) == 0  # it finished within the timeout
    resp = await in_flight
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/health")).status == 503
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 503
    assert_error(await resp.json(), 503)


async def test_drain_timeout_aborts_the_rest(client) -> None:
    from service_fixtures import wait_pool_idle

    body = {"prompt": "drain", "max_tokens": 120, "ignore_eos": True, "stream": True}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    await resp.content.readline()
    assert await drain(client.server.app, timeout=0.01) == 1
    await wait_pool_idle(client.server.app)

"""N4 and N5: /tokenize and /detokenize apply generation's length bound before any work, tenants
take turns at the request-sized CPU workers, and client text reaches the log bounded."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvcore.engine.fair_queue import FairQueue
from kvcore.service import STATE_KEY
from kvcore.service.logtext import MAX_LOGGED_CHARS, log_text
from kvcore.service.protocol import MAX_USER_CHARS
from service_fixtures import tiny_app

MAX_MODEL_LEN = 128  # tiny_app's


@pytest.fixture
def app(tiny_model_dir: Any) -> Any:
    return tiny_app(tiny_model_dir)


def _spy_encode(app: Any) -> list[int]:
    """Count the tokenizer's encode calls (the work a bound must come before)."""
    tokenizer = app[STATE_KEY].engine.tokenizer
    calls: list[int] = []
    real = tokenizer.encode

    def encode(text: str, **kwargs: Any) -> list[int]:
        calls.append(len(text))
        return real(text, **kwargs)

    tokenizer.encode = encode
    return calls


@pytest.mark.asyncio
async def test_tokenize_refuses_a_text_no_context_could_hold_before_tokenizing(
        aiohttp_client: Any, app: Any) -> None:
    client = await aiohttp_client(app)
    calls = _spy_encode(app)
    max_chars = MAX_MODEL_LEN * app[STATE_KEY].engine.tokenizer.max_token_chars
    for body, param in (({"prompt": "a" * (max_chars + 1)}, "prompt"),
                        ({"messages": [{"role": "user", "content": "b" * (max_chars + 1)}]},
                         "messages")):
        resp = await client.post("/tokenize", json=body)
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        assert error["param"] == param and "context length" in error["message"]
    assert calls == []  # refused before any tokenizing
    # within the character bound but over the context once tokenized: refused too
    resp = await client.post("/tokenize", json={"prompt": "z " * MAX_MODEL_LEN})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await client.post("/tokenize", json={"prompt": "hello"})
    assert resp.status == 200 and (await resp.json())["count"] > 0


@pytest.mark.asyncio
async def test_detokenize_refuses_more_tokens_than_the_context(aiohttp_client: Any,
                                                               app: Any) -> None:
    client = await aiohttp_client(app)
    resp = await client.post("/detokenize", json={"tokens": [65] * (MAX_MODEL_LEN + 1)})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "tokens"
    resp = await client.post("/detokenize", json={"tokens": [65] * MAX_MODEL_LEN})
    assert resp.status == 200


@pytest.mark.asyncio
async def test_a_long_user_is_400_and_logged_users_are_bounded(aiohttp_client: Any,
                                                               app: Any) -> None:
    client = await aiohttp_client(app)
    body = {"prompt": "a", "max_tokens": 1}
    resp = await client.post("/v1/completions", json=body | {"user": "u" * 3_000_000})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "user"
    user = "x\n{\"forged\": 1}\x1b[31m" + "y" * (MAX_USER_CHARS - 20)
    assert len(user) == MAX_USER_CHARS
    with capture_logs() as logs:
        resp = await client.post("/v1/completions", json=body | {"user": user})
        assert resp.status == 200
    logged = next(e["user"] for e in logs if e.get("event") == "request")
    assert logged == log_text(user) and len(logged) < MAX_LOGGED_CHARS + 40
    assert logged.startswith("x\\n{\"forged\": 1}\\x1b[31m") and logged.endswith("more chars]")
    assert "\n" not in logged and "\x1b" not in logged


def test_log_text_bounds_and_escapes() -> None:
    assert log_text(None) is None and log_text("plain") == "plain"
    assert log_text("a\r\nb\x00\x7f\u2028") == "a\\r\\nb\\x00\\x7f\\u2028"
    assert log_text("é" * 10, 4) == "éééé...[6 more chars]"


def test_fair_queue_gives_a_waiting_tenant_the_next_turn() -> None:
    async def main() -> list[str]:
        queue = FairQueue(1)
        order: list[str] = []

        async def work(tenant: str) -> None:
            await queue.acquire(tenant)
            try:
                order.append(tenant)
                await asyncio.sleep(0.01)
            finally:
                queue.release()

        hog = [asyncio.create_task(work("hog")) for _ in range(5)]
        await asyncio.sleep(0)  # the hog's five are in line (one runs)
        other = [asyncio.create_task(work("other")) for _ in range(2)]
        cancelled = asyncio.create_task(work("gone"))
        await asyncio.sleep(0)
        cancelled.cancel()  # a caller that leaves while in line loses its place, nobody else's
        await asyncio.gather(*hog, *other, cancelled, return_exceptions=True)
        assert queue.num_free == 1
        return order

    # the other tenant waits for one of the hog's tasks at a time, not for all of them
    assert asyncio.run(main()) == ["hog", "hog", "other", "hog", "other", "hog", "hog"]
    with pytest.raises(ValueError, match="num_slots"):
        FairQueue(0)

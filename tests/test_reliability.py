"""Regression tests for the fault-isolation findings D1-D8 (issue 12), over HTTP and below it."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import time
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from engine_helpers import inject_sampling_fault
from kvcore.config import ParamError
from kvcore.engine import AsyncEngine
from kvcore.sampling import BeamSearchParams, RowSampler, SamplingParams, SamplingRow
from kvcore.sampling.beam import length_penalized
from kvcore.service import STATE_KEY, drain
from service_fixtures import engine_of, tiny_app, wait_pool_idle

FLOATS = [0.0, 1e-45, 1e-38, 1e38, math.inf, math.nan, -1.0, -1e-38, 1.0, 2.0]
FLOAT_PARAMS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]


def _sse(raw: bytes) -> list[Any]:
    """The data of every SSE event ("[DONE]" as a string)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def _logged(logs: list[dict[str, Any]], num: int) -> None:
    """Until `num` request lines are logged (a handler logs after its response is sent)."""
    for _ in range(500):
        if sum(e.get("event") == "request" for e in logs) >= num:
            return
        await asyncio.sleep(0.01)


# --- D1: every float parameter is either refused by name or safe to compute with ---

@pytest.mark.parametrize("name", FLOAT_PARAMS)
@pytest.mark.parametrize("value", FLOATS)
def test_float_sampling_params_are_refused_or_safe(name: str, value: float) -> None:
    try:
        params = SamplingParams(**{name: value}, max_tokens=4)
    except ParamError as e:
        assert e.param == name and name in str(e)
        return
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 300)) * 30).astype(np.float32)  # (B, V) large logits
    rows = [SamplingRow(params, [1, 2, 2], [3, 3], seed=i) for i in range(3)]
    out = RowSampler([0], 300)(logits, rows)
    assert ((out.token_ids >= 0) & (out.token_ids < 300)).all()


@pytest.mark.parametrize("value", [*FLOATS, 1000.0, -1000.0, 5.0, -5.0])
def test_length_penalty_is_refused_or_safe(value: float) -> None:
    try:
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=value)
    except ParamError as e:
        assert e.param == "length_penalty"
        return
    for length in (1, 2, 8192, 131072):
        assert math.isfinite(length_penalized(-3.5, length, value))


@pytest_asyncio.fixture
async def client(aiohttp_client, tiny_model_dir):
    return await aiohttp_client(tiny_app(tiny_model_dir, max_body_size=8 << 20,
                                         body_timeout=0.5))


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.asyncio
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "Hi", "max_tokens": 2, "repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"prompt": "Hi", "use_beam_search": True, "n": 2, "length_penalty": 1000, "max_tokens": 6,
      "ignore_eos": True}, "length_penalty"),
])
async def test_d1_bad_sampling_values_are_400(client, body: dict, param: str) -> None:
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
    await wait_pool_idle(client.app)


# --- D2: a stream that fails after its headers ends with one error event and [DONE] ---

def _fail_sampling_of_seed(app: Any, seed: int) -> None:
    def fault(rows: Any) -> None:
        if any(r.params.seed == seed for r in rows):
            raise RuntimeError("injected")

    inject_sampling_fault(engine_of(app), fault)


@pytest.mark.asyncio
async def test_d2_a_failing_stream_ends_well_formed_and_others_go_on(client) -> None:
    _fail_sampling_of_seed(client.app, 666)
    good = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "temperature": 0,
            "stream": True}
    bad = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "seed": 666,
           "stream": True}
    with capture_logs() as logs:
        good_resp, bad_resp = await asyncio.gather(client.post("/v1/completions", json=good),
                                                   client.post("/v1/completions", json=bad))
        good_events = _sse(await good_resp.read())
        bad_raw = await bad_resp.read()
        await _logged(logs, 2)
    assert good_events[-1] == "[DONE]"
    assert good_events[-2]["choices"][0]["finish_reason"] == "length"
    assert b"HTTP/1.1" not in bad_raw
    if bad_resp.status == 200:  # the error came after the headers: in the stream
        events = _sse(bad_raw)
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert all("error" not in e for e in events[:-2])
    else:
        assert bad_resp.status == 500 and "error" in json.loads(bad_raw)
    outcomes = sorted(e["outcome"] for e in logs if e.get("event") == "request")
    assert outcomes[0].startswith("error 500") and outcomes[1] == "ok"
    await wait_pool_idle(client.app)


@pytest.mark.asyncio
async def test_d2_a_failing_json_request_is_a_500_in_the_openai_shape(client) -> None:
    _fail_sampling_of_seed(client.app, 666)
    resp = await client.post("/v1/completions", json={"prompt": "x", "seed": 666})
    assert resp.status == 500
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}


# --- D3: bad text and media are 4xx, never 500 ---

@pytest.mark.asyncio
@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": "a", "cache_salt": "\\udfff"}', "cache_salt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800"}]}',
     "messages"),
    ("/tokenize", '{"prompt": "\\ud800x"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": ["user"], "content": "a"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": {"a": 1}, "content": "a"}]}', "messages"),
])
async def test_d3_bad_text_and_types_are_400(client, path: str, raw: str, param: str) -> None:
    resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


@pytest.mark.asyncio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
async def test_d3_compressed_or_non_json_bodies_are_415(client, path: str) -> None:
    body = json.dumps({"prompt": "a", "tokens": [1]} | CHAT).encode()
    resp = await client.post(path, data=gzip.compress(body),
                             headers={"Content-Type": "application/json",
                                      "Content-Encoding": "gzip"})
    assert resp.status == 415
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        resp = await client.post(path, data=body, headers={"Content-Type": content_type})
        assert resp.status == 415
        assert (await resp.json())["error"]["type"] == "UnsupportedMediaTypeError"


@pytest.mark.asyncio
@pytest.mark.parametrize(("field", "value"), [
    ("suffix", "end"), ("best_of", 3), ("functions", [{"name": "f"}]),
    ("allowed_token_ids", [5, 6]), ("bad_words", ["x"]),  # vLLM extras kvcore does not implement
])
async def test_unsupported_fields_are_400_by_name(client, field: str, value: Any) -> None:
    for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", CHAT)):
        resp = await client.post(path, json=body | {field: value})
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == field
    ok = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1,
                                                    "best_of": 1, "suffix": None})
    assert ok.status == 200


# --- D4: tokenizing a huge body never stalls the event loop ---

@pytest.mark.asyncio
async def test_d4_health_and_streams_are_answered_while_a_4mb_tokenize_arrives(client) -> None:
    stream = await client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 60, "ignore_eos": True, "stream": True})
    await stream.content.readuntil(b"\n\n")  # the stream is running
    big = asyncio.create_task(client.post("/tokenize", json={"prompt": "ab " * 1_400_000}))
    await asyncio.sleep(0.05)  # the 4 MB body is on its way
    health = await client.get("/health")
    assert health.status == 200
    await stream.content.readuntil(b"\n\n")  # the stream's next chunk
    resp = await big  # over generation's length bound: refused before tokenizing (N4)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    await stream.read()


@pytest.mark.asyncio
async def test_d4_an_over_long_prompt_is_refused_before_tokenizing(client) -> None:
    engine = engine_of(client.app)
    calls = []
    real = engine.tokenizer.encode
    engine.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)  # type: ignore
    limit = engine.max_model_len * engine.tokenizer.max_token_chars
    resp = await client.post("/v1/completions", json={"prompt": "x" * (limit + 1)})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    assert not calls


# --- D5: a body shorter than its Content-Length times out ---

@pytest.mark.asyncio
async def test_d5_a_stalled_body_is_408(client) -> None:
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 408")
    writer.close()


# --- D7: a drain that times out ends streams with finish_reason abort and [DONE] ---

@pytest.mark.asyncio
async def test_d7_drain_timeout_aborts_streams_cleanly(client) -> None:
    resp = await client.post("/v1/chat/completions", json=CHAT | {
        "max_tokens": 100, "ignore_eos": True, "stream": True})
    await resp.content.readuntil(b"\n\n")
    aborted = await drain(client.app, timeout=0.05)
    events = _sse(await resp.read())
    assert aborted == 1
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert client.app[STATE_KEY].engine is not None
    await wait_pool_idle(client.app)


# --- D8: limits count sequences, not calls ---

@pytest.mark.asyncio
async def test_d8_prompts_times_n_is_bounded(client) -> None:
    resp = await client.post("/v1/completions", json={
        "prompt": ["a"] * 256, "n": 8, "max_tokens": 4})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "n"


@pytest.mark.asyncio
async def test_d8_waiting_sequences_are_counted_and_429s_are_logged(aiohttp_client,
                                                                    tiny_model_dir) -> None:
    app = tiny_app(tiny_model_dir, max_waiting=4, engine_kwargs={"max_num_seqs": 3})
    client = await aiohttp_client(app)
    model = engine_of(app).core.runner.model
    real = model.forward

    def slow_forward(*args: Any) -> Any:  # so the calls below meet a busy engine
        time.sleep(0.02)
        return real(*args)

    model.forward = slow_forward  # type: ignore[method-assign]
    long = {"prompt": "a", "max_tokens": 60, "ignore_eos": True}
    first = asyncio.create_task(client.post("/v1/completions", json=long | {"n": 2}))
    for _ in range(200):  # until the first call runs (2 of max_num_seqs 3: the next 3 wait),
        await asyncio.sleep(0.01)  # as the engine published it (what admission reads)
        if app[STATE_KEY].engine.stats().num_running == 2:  # type: ignore[union-attr]
            break
    queued = asyncio.create_task(client.post("/v1/completions", json=long | {"n": 3}))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if app[STATE_KEY].engine.num_waiting == 3:  # type: ignore[union-attr]
            break
    with capture_logs() as logs:
        refused = await client.post("/v1/completions", json=long | {"n": 2})  # 3 + 2 > 4
        await _logged(logs, 1)
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert any(e.get("event") == "request" and e["outcome"] == "error 429" for e in logs)
    assert (await first).status == 200 and (await queued).status == 200
    await wait_pool_idle(app)


def test_d8_forks_never_exceed_max_num_seqs(tiny_model_dir) -> None:
    from engine_helpers import assert_pool_empty, make_engine

    engine = make_engine(tiny_model_dir, max_num_seqs=6)
    for i in range(5):
        engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(n=4, max_tokens=5,
                                                                   seed=i, ignore_eos=True))
    engine.add_request("beam", [9, 9], BeamSearchParams(beam_width=3, max_tokens=4,
                                                        ignore_eos=True))
    with pytest.raises(ParamError) as err:
        engine.add_request("wide", [1], SamplingParams(n=7))
    assert err.value.param == "n"
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert 4 <= peak <= 6
    assert_pool_empty(engine)


def test_async_engine_num_waiting_counts_sequences(tiny_model_dir) -> None:
    from engine_helpers import make_engine

    async def main() -> int:
        engine = AsyncEngine(make_engine(tiny_model_dir))
        await engine.start()
        try:  # a request checked and queued to be added: its 5 sequences wait
            seq = engine.engine.check_request("r", [5, 6], SamplingParams(n=5))
            engine._adds.append((seq, None))  # type: ignore[arg-type]
            return engine.num_waiting
        finally:
            engine._adds.clear()
            await engine.stop()

    assert asyncio.run(main()) == 5


@pytest.mark.asyncio
async def test_a_call_that_can_never_run_is_a_400_even_when_the_queue_is_full(
        aiohttp_client, tiny_model_dir) -> None:
    """The engine's context checks run before the server's queue limit: with the waiting queue
    full (max_waiting 0 refuses every call as busy), a call that no engine could ever run is
    still bad input naming its parameter, and the request log records it."""
    app = tiny_app(tiny_model_dir, max_waiting=0)  # max_model_len 128
    client = await aiohttp_client(app)
    with capture_logs() as logs:
        too_long = await client.post("/v1/completions", json={"prompt": [5] * 100,
                                                              "max_tokens": 50})
        await _logged(logs, 1)
    assert too_long.status == 400
    assert (await too_long.json())["error"]["param"] == "max_tokens"
    assert any(e.get("event") == "request" and e["outcome"] == "error 400" for e in logs)
    no_room = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a" * 300}]})
    assert no_room.status == 400 and (await no_room.json())["error"]["param"] == "prompt"
    busy = await client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 5})
    assert busy.status == 429  # a call that could run is still refused as busy
    await wait_pool_idle(app)


@pytest.mark.asyncio
async def test_calls_refused_before_the_engine_write_their_request_log_line(client) -> None:
    """Bad input refused while the call is parsed still leaves the one request log line
    (outcome, endpoint, tenant), and nothing of the body."""
    with capture_logs() as logs:
        bad = await client.post("/v1/completions", json={"prompt": "secret words",
                                                         "temperature": -1})
        chat = await client.post("/v1/chat/completions", json={"messages": "nope"})
        await _logged(logs, 2)
    assert bad.status == 400 and chat.status == 400
    lines = [e for e in logs if e.get("event") == "request"]
    assert [(e["endpoint"], e["outcome"]) for e in lines] == [("completion", "error 400"),
                                                              ("chat", "error 400")]
    assert all(e["tenant"] == "anonymous" and e["request_id"] is None for e in lines)
    assert "secret" not in json.dumps(logs, default=str)

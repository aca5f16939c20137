"""OpenAI-compatible routes on the tiny model: JSON, SSE and msgpack answers and their shapes."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgpack
import pytest
import pytest_asyncio

from kvcore.request import RequestOutput, merge_outputs
from kvcore.sampling.params import SamplingParams
from kvcore.service import STATE_KEY
from service_fixtures import MODEL_NAME, engine_of, tiny_app, wait_pool_idle

pytestmark = pytest.mark.asyncio

GREEDY = {"temperature": 0, "ignore_eos": True}


def sse_events(raw: str) -> list[Any]:
    """The payloads of an SSE body; asserts the framing (data lines, blank-line separated)."""
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def msgpack_frames(raw: bytes) -> list[dict[str, Any]]:
    frames, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack(">I", raw[offset:offset + 4])
        frames.append(msgpack.unpackb(raw[offset + 4:offset + 4 + length]))
        offset += 4 + length
    assert offset == len(raw)
    return frames


@pytest_asyncio.fixture
async def client(aiohttp_client, tiny_model_dir):
    return await aiohttp_client(tiny_app(tiny_model_dir))


async def _offline(client, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
    """The same request straight through the engine (no HTTP), as the oracle."""
    engine = client.server.app[STATE_KEY].engine
    return merge_outputs([output async for output in engine.generate(prompt_ids, params)])


async def test_completion_json_matches_engine(client) -> None:
    resp = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello",
                                                      "max_tokens": 6, **GREEDY})
    assert resp.status == 200
    body = await resp.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert body["id"].startswith("cmpl-") and resp.headers["X-Request-Id"] == body["id"]
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    ids = (await (await client.post("/tokenize", json={"prompt": "hello"})).json())["tokens"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["usage"]["completion_tokens"] == 6 == body["usage"]["total_tokens"] - len(ids)
    oracle = await _offline(client, ids, SamplingParams(max_tokens=6, temperature=0,
                                                        ignore_eos=True))
    assert choice["text"] == oracle.outputs[0].text


async def test_completion_stream_equals_json(client) -> None:
    body = {"prompt": "stream me", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(await resp.text())
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    assert all(c["object"] == "text_completion" and c["id"] == usage["id"] for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    plain = await (await client.post("/v1/completions", json={**body, "stream": False,
                                                              "stream_options": None})).json()
    assert streamed == plain["choices"][0]["text"]


async def test_chat_json_and_stream(client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_completion_tokens": 7, **GREEDY}
    plain = await (await client.post("/v1/chat/completions", json=body)).json()
    assert plain["object"] == "chat.completion" and plain["id"].startswith("chatcmpl-")
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant" and plain["usage"]["completion_tokens"] == 7
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = sse_events(await resp.text())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert streamed == message["content"]
    # the prompt is the chat template's rendering of the messages
    tok = await (await client.post("/tokenize", json={"messages": messages})).json()
    assert plain["usage"]["prompt_tokens"] == tok["count"]


async def test_n_choices_by_index(client) -> None:
    body = {"prompt": "abc", "max_tokens": 5, "n": 3, "seed": 7, "temperature": 1.0,
            "ignore_eos": True, "stream": True}
    chunks = sse_events(await (await client.post("/v1/completions", json=body)).text())
    texts: dict[int, str] = {}
    finished = set()
    for chunk in chunks:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1, 2}
    plain = await (await client.post("/v1/completions", json={**body, "stream": False})).json()
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2]
    # seeded: the same choices either way
    assert [texts[i] for i in range(3)] == [c["text"] for c in plain["choices"]]
    assert plain["usage"]["completion_tokens"] == 15


async def test_completion_logprobs_shape(client) -> None:
    body = {"prompt": "log", "max_tokens": 4, "logprobs": 2, **GREEDY}
    choice = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(4)]
    ids = (await (await client.post("/tokenize", json={"prompt": "log"})).json())["tokens"]
    oracle = (await _offline(client, ids, SamplingParams(max_tokens=4, temperature=0,
                                                         ignore_eos=True, logprobs=2))).outputs[0]
    assert oracle.logprobs is not None
    tokenizer = engine_of(client.server.app).tokenizer
    for i, entry in enumerate(oracle.logprobs):
        token = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        assert lp["tokens"][i] == token
        assert lp["token_logprobs"][i] == pytest.approx(entry.logprob)
        top = lp["top_logprobs"][i]
        # the sampled token next to the top 2 (byte tokens may decode to the same text)
        assert token in top and 1 <= len(top) <= 3
        assert set(top) == {token} | {tokenizer.decode([t], skip_special_tokens=False)
                                      for t, _ in entry.top}
    stream = sse_events(await (await client.post("/v1/completions",
                                                 json={**body, "stream": True})).text())
    streamed = [t for c in stream if c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"])


async def test_chat_logprobs_shape(client) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2, **GREEDY}
    choice = (await (await client.post("/v1/chat/completions", json=body)).json())["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])


async def test_msgpack_stream(client) -> None:
    body = {"prompt": [5, 6, 7], "max_tokens": 6, **GREEDY}
    resp = await client.post("/v1/completions", json=body,
                             headers={"Accept": "application/x-msgpack"})
    assert resp.status == 200 and resp.headers["Content-Type"] == "application/x-msgpack"
    frames = msgpack_frames(await resp.read())
    assert all(set(f) == {"index", "token_ids", "text", "finish_reason"} for f in frames)
    assert frames[-1]["finish_reason"] == "length"
    token_ids = [t for f in frames for t in f["token_ids"]]
    plain = await (await client.post("/v1/completions", json=body)).json()
    assert "".join(f["text"] for f in frames) == plain["choices"][0]["text"]
    oracle = await _offline(client, [5, 6, 7], SamplingParams(max_tokens=6, temperature=0,
                                                              ignore_eos=True))
    assert token_ids == oracle.outputs[0].token_ids


async def test_echo_and_stop(client) -> None:
    plain = await (await client.post("/v1/completions", json={
        "prompt": "echo", "max_tokens": 3, "echo": True, **GREEDY})).json()
    assert plain["choices"][0]["text"].startswith("echo")
    free = (await (await client.post("/v1/completions", json={
        "prompt": "stop", "max_tokens": 12, **GREEDY})).json())["choices"][0]["text"]
    stop = free[3:5] if len(free) > 5 else free[-1]
    cut = (await (await client.post("/v1/completions", json={
        "prompt": "stop", "max_tokens": 12, "stop": [stop], **GREEDY})).json())["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == free[:free.index(stop)]
    await wait_pool_idle(client.server.app)


async def test_beam_search(client) -> None:
    beams = await (await client.post("/v1/completions", json={
        "prompt": "beam", "max_tokens": 4, "n": 2, "use_beam_search": True,
        "ignore_eos": True})).json()
    assert [c["index"] for c in beams["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in beams["choices"])
    await wait_pool_idle(client.server.app)


async def test_models_tokenize_detokenize_version_openapi(client) -> None:
    models = await (await client.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL_NAME
    assert models["data"][0]["max_model_len"] == 128
    tok = await (await client.post("/tokenize", json={"prompt": "héllo wörld",
                                                      "return_token_strs": True})).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    detok = await (await client.post("/detokenize", json={"tokens": tok["tokens"]})).json()
    assert detok["prompt"] == "héllo wörld"
    assert (await (await client.get("/version")).json())["version"]
    assert (await client.get("/health")).status == 200
    spec = await (await client.get("/openapi.json")).json()
    routes = {(r.method, r.resource.canonical) for r in client.server.app.router.routes()
              if r.method != "HEAD"}
    assert {path for _, path in routes} == set(spec["paths"])
    for method, path in routes:
        assert method.lower() in spec["paths"][path]


async def test_metrics_after_requests(client) -> None:
    await client.post("/v1/completions", json={"prompt": "metrics", "max_tokens": 3, **GREEDY})
    text = await (await client.get("/metrics")).text()
    for name in ("kvcore:num_requests_running", "kvcore:num_requests_waiting",
                 "kvcore:kv_cache_usage_perc", "kvcore:prefix_cache_queries_total",
                 "kvcore:prefix_cache_hits_total", "kvcore:num_preemptions_total",
                 "kvcore:prompt_tokens_total", "kvcore:generation_tokens_total",
                 'kvcore:request_success_total{finished_reason="length"',
                 "kvcore:time_to_first_token_seconds_bucket",
                 "kvcore:inter_token_latency_seconds_bucket",
                 "kvcore:e2e_request_latency_seconds_bucket",
                 "kvcore:request_queue_time_seconds_bucket", "kvcore:cache_config_info{"):
        assert name in text, name
    assert f'kvcore:generation_tokens_total{{model_name="{MODEL_NAME}"}} 3.0' in text

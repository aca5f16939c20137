"""Anthropic's Messages API through the official `anthropic` client against a live server:
text answers, tools under each tool_choice with a tool_use -> tool_result loop, streamed ==
whole answers (messages.stream), stop reasons, count_tokens, x-api-key auth and errors in
Anthropic's shape naming their field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import pytest

from kvcore.model.tokenizer import Tokenizer
from service_fixtures import MODEL_NAME, tiny_app, wait_pool_idle
from service_live import live_server

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"], "additionalProperties": False,
    "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}
ENGINE = {"max_model_len": 1024, "num_blocks": 1024, "max_num_batched_tokens": 1024}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _bias(model_dir: Path) -> dict[str, int]:
    """Closing characters made likely: a random-weight model ends its strings and objects."""
    tokenizer = Tokenizer.from_dir(model_dir)
    bias = {str(tokenizer.encode(c)[0]): b for c, b in (('"', 9), ("}", 6), ("]", 6))}
    return bias | {str(tokenizer.eos_token_id): 6}


def _client(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def test_text_tools_loop_and_stream(tiny_model_dir: Path) -> None:
    extra: dict[str, Any] = {"logit_bias": _bias(tiny_model_dir), "temperature": 1.0, "seed": 3}
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = _client(server.url)
        text = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=ASK,
                                      system="Be brief.", extra_body={"ignore_eos": True})
        assert text.stop_reason == "max_tokens" and text.usage.output_tokens == 6
        assert [b.type for b in text.content] == ["text"] and text.content[0].text
        assert text.id.startswith("msg_") and text.role == "assistant"

        kwargs: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 120, "messages": ASK,
                                  "tools": [WEATHER], "tool_choice": {"type": "any"},
                                  "extra_body": extra}
        done = client.messages.create(**kwargs)
        assert done.stop_reason == "tool_use", done
        uses = [b for b in done.content if b.type == "tool_use"]
        assert uses and all(u.name == "get_weather" for u in uses)
        for use in uses:
            jsonschema.validate(use.input, WEATHER["input_schema"])
        with client.messages.stream(**kwargs) as stream:
            deltas = [e for e in stream if e.type == "content_block_delta"]
            streamed = stream.get_final_message()
        assert deltas and streamed.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "input", None), getattr(b, "text", None))
                for b in streamed.content] == [
            (b.type, getattr(b, "input", None), getattr(b, "text", None)) for b in done.content]

        turns: list[Any] = [*ASK, {"role": "assistant", "content": [
            u.model_dump() for u in uses]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": json.dumps({"t": 21})}
                for u in uses]}]
        second = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=turns,
                                        tools=[WEATHER], extra_body={"ignore_eos": True})
        assert second.stop_reason in ("max_tokens", "tool_use")
        assert second.usage.input_tokens > done.usage.input_tokens
        assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt is cached

        # a stop sequence the greedy answer reaches: stop_reason names it
        greedy = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK,
                                        extra_body={"ignore_eos": True, "temperature": 0.0})
        answer = greedy.content[0].text  # type: ignore[union-attr]
        stop = answer[3:5]
        cut = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=ASK,
                                     stop_sequences=[stop],
                                     extra_body={"ignore_eos": True, "temperature": 0.0})
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        count = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=[WEATHER])
        assert count.input_tokens == done.usage.input_tokens
        assert server.app is not None
        server.call(wait_pool_idle(server.app))


BAD: list[tuple[dict[str, Any], str]] = [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
     "messages[2].content[0].tool_use_id"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": ASK, "extra_body": {"max_tokens": "many"}}, "max_tokens"),
    ({"messages": ASK, "extra_body": {"temperature": "hot"}}, "temperature"),
    ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0].type"),
    ({"messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": ASK, "stop_sequences": [3]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x" * 600_000}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_is_a_400_in_anthropics_shape(tiny_model_dir: Path, body: dict[str, Any],
                                                param: str) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = _client(server.url)
        full = {"model": MODEL_NAME, "max_tokens": 4} | body
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(**full)
        error = bad.value.body
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert param in error["error"]["message"], error


def test_x_api_key_auth(tiny_model_dir: Path) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE, api_keys=["k1"])) as server:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            _client(server.url, "wrong").messages.create(model=MODEL_NAME, max_tokens=2,
                                                        messages=ASK)
        assert denied.value.body["error"]["type"] == "authentication_error"
        ok = _client(server.url, "k1").messages.create(model=MODEL_NAME, max_tokens=2,
                                                       messages=ASK)
        assert ok.usage.output_tokens >= 1
        with pytest.raises(anthropic.NotFoundError):
            _client(server.url, "k1").messages.create(model="other", max_tokens=2, messages=ASK)

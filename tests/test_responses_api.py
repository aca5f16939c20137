"""OpenAI's Responses API through the official `openai` client against a live server: text
streamed and not, function tools with a function_call_output loop over previous_response_id
(3 turns, the later ones cache hits), text.format json_schema and responses.parse, stored
responses (GET / DELETE, per tenant), and bad input as 4xx naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from kvcore.model.tokenizer import Tokenizer
from service_fixtures import MODEL_NAME, tiny_app, wait_pool_idle
from service_live import live_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/unit"}},
               "required": ["city", "unit"], "additionalProperties": False,
               "$defs": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}
ENGINE = {"max_model_len": 1024, "num_blocks": 1024, "max_num_batched_tokens": 1024}


class Person(pydantic.BaseModel):
    name: str
    tags: set[str]  # uniqueItems: accepted, checked after generation


def _bias(model_dir: Path) -> dict[str, int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    bias = {str(tokenizer.encode(c)[0]): b for c, b in (('"', 9), ("}", 6), ("]", 6))}
    return bias | {str(tokenizer.eos_token_id): 6}


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_text_streamed_and_whole(tiny_model_dir: Path) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = _client(server.url)
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "input": "Hello there",
                                  "instructions": "Be brief.", "max_output_tokens": 6,
                                  "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client.responses.create(**kwargs)
        assert whole.status == "incomplete" and whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.output_text and whole.usage is not None and whole.usage.output_tokens == 6
        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text == events[-1].response.output_text  # type: ignore
        assert server.app is not None
        server.call(wait_pool_idle(server.app))


def test_tools_loop_over_three_turns(tiny_model_dir: Path) -> None:
    extra = {"logit_bias": _bias(tiny_model_dir)}
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = _client(server.url)
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "tools": [WEATHER],
                                  "tool_choice": "required", "max_output_tokens": 120,
                                  "temperature": 1.0, "extra_body": extra | {"seed": 4}}
        first = client.responses.create(input="Weather in Paris?", **kwargs)
        calls = [o for o in first.output if o.type == "function_call"]
        assert calls and first.status == "completed", first
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        streamed = list(client.responses.create(input="Weather in Paris?", stream=True,
                                                **kwargs))
        done = [e.item for e in streamed if e.type == "response.output_item.done"]
        assert [(c.name, c.arguments) for c in done] == [  # type: ignore[union-attr]
            (c.name, c.arguments) for c in calls]  # same seed: the same calls, streamed
        args = "".join(e.delta for e in streamed
                       if e.type == "response.function_call_arguments.delta")
        assert args == "".join(c.arguments for c in calls)

        second = client.responses.create(
            model=MODEL_NAME, previous_response_id=first.id, max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": c.call_id,
                    "output": json.dumps({"t": 21})} for c in calls],
            tools=[WEATHER], extra_body={"ignore_eos": True})
        third = client.responses.create(model=MODEL_NAME, previous_response_id=second.id,
                                        input="Thanks!", max_output_tokens=4, tools=[WEATHER],
                                        extra_body={"ignore_eos": True})
        assert first.usage and second.usage and third.usage
        assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens > 0
        assert third.usage.input_tokens_details.cached_tokens > 0
        assert client.responses.retrieve(third.id).output_text == third.output_text
        client.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(third.id)
        assert server.app is not None
        server.call(wait_pool_idle(server.app))  # stored responses hold no KV blocks


def test_text_format_and_parse(tiny_model_dir: Path) -> None:
    extra = {"logit_bias": _bias(tiny_model_dir), "ignore_eos": False}
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = _client(server.url)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}
        done = client.responses.create(
            model=MODEL_NAME, input="Answer", max_output_tokens=60, temperature=0,
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                             "strict": True}}, extra_body=extra)
        jsonschema.validate(json.loads(done.output_text), schema)
        parsed = client.responses.parse(model=MODEL_NAME, input="Who?", text_format=Person,
                                        max_output_tokens=120, temperature=0, extra_body=extra)
        assert isinstance(parsed.output_parsed, Person)


def test_previous_response_of_another_tenant_is_a_404(tiny_model_dir: Path) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE, api_keys=["ka", "kb"])) as server:
        a, b = _client(server.url, "ka"), _client(server.url, "kb")
        mine = a.responses.create(model=MODEL_NAME, input="secret", max_output_tokens=2)
        for attempt in (lambda: b.responses.retrieve(mine.id),
                        lambda: b.responses.delete(mine.id),
                        lambda: b.responses.create(model=MODEL_NAME, input="x",
                                                   previous_response_id=mine.id),
                        lambda: a.responses.create(model=MODEL_NAME, input="x",
                                                   previous_response_id="resp_unknown")):
            with pytest.raises(openai.NotFoundError) as missing:
                attempt()
            assert "secret" not in str(missing.value.body)
        assert a.responses.retrieve(mine.id).id == mine.id
        unstored = a.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2,
                                      store=False)
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(unstored.id)


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": 5}, "input"),
    ({"input": [{"type": "image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
     "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "x" * 600_000}, "input"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_names_its_field(tiny_model_dir: Path, body: dict[str, Any],
                                   param: str) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        with pytest.raises(openai.BadRequestError) as bad:
            _client(server.url).responses.create(model=MODEL_NAME, extra_body=body)
        assert bad.value.body["param"] == param, bad.value.body  # type: ignore[index]

"""Structured outputs and tool calls through the official `openai` client against a live server:
response_format (and the client's parse), vLLM's structured_outputs, tools with tool_choice
"required" / named (streamed and not), a multi-turn exchange with a Qwen3-style template, and
the 400s of bad constraints."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from kvcore.model.tokenizer import Tokenizer
from service_fixtures import MODEL_NAME, tiny_app, wait_pool_idle
from service_live import live_server
from tiny_model import make_tiny_model
from tool_templates import QWEN3_STYLE_TEMPLATE

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
        "additionalProperties": False}}}
# the tools' description makes prompts of ~800 byte-level tokens
ENGINE = {"max_model_len": 1024, "num_blocks": 1024, "max_num_batched_tokens": 1024}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]


def _bias(model_dir: Path) -> dict[str, int]:
    """Closing characters made likely, as in the engine tests: a random-weight model ends its
    strings and objects; the mask alone decides what is allowed."""
    tokenizer = Tokenizer.from_dir(model_dir)
    bias = {str(tokenizer.encode(c)[0]): b for c, b in (('"', 9), ("}", 6), ("]", 6))}
    return bias | {str(tokenizer.eos_token_id): 6}  # EOS: allowed once a call is complete


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]  # type: ignore[no-any-return]


def _accumulate(stream: Any) -> tuple[dict[int, dict[str, str]], str | None, str]:
    """delta.tool_calls folded as the openai client's helpers do: id and name from the first
    item of an index, arguments concatenated."""
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                call = calls.setdefault(item.index, {"id": "", "name": "", "arguments": ""})
                if item.id:
                    assert not call["id"], "the id comes once, first"
                    call["id"], call["name"] = item.id, item.function.name
                call["arguments"] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish, content


def test_tools_required_and_named(tiny_model_dir: Path) -> None:
    bias = _bias(tiny_model_dir)
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for seed in range(3):
            done = client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME],
                tool_choice="required", max_tokens=120, seed=seed, temperature=1.0,
                logit_bias=bias)
            choice = done.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), _schema(tool))
                assert call.type == "function" and call.id.startswith("call_")
        named = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False, temperature=0, logit_bias=bias)
        calls = named.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments), _schema(TIME))

        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
            max_tokens=120, seed=1, temperature=1.0, logit_bias=bias, stream=True)
        streamed, finish, content = _accumulate(stream)
        assert finish == "tool_calls" and not content.strip()
        again = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
            max_tokens=120, seed=1, temperature=1.0, logit_bias=bias)
        expected = again.choices[0].message.tool_calls or []
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in expected]  # same seed, same calls
        assert server.app is not None
        server.call(wait_pool_idle(server.app))
        server.call(asyncio.sleep(0.2))  # the driver publishes its stats between steps
        with urllib.request.urlopen(f"{server.url}/metrics") as resp:
            metrics = resp.read().decode()
        assert re.search(r'kvcore:structured_output_requests_total\{kind="tools_required",'
                         r'model_name="tiny"\} 5\.0', metrics), metrics
        count = re.search(r"kvcore:structured_output_mask_seconds_count\S* (\d+)", metrics)
        assert count is not None and int(count.group(1)) > 0


def test_response_format_parse_and_structured_outputs(tiny_model_dir: Path) -> None:
    bias = _bias(tiny_model_dir)
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        parsed = client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Person, max_tokens=120,
            temperature=0, logit_bias=bias)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person)
        obj = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, response_format={"type": "json_object"},
            max_tokens=120, temperature=0, logit_bias=bias)
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
        regex = client.completions.create(
            model=MODEL_NAME, prompt="Code:", max_tokens=20, temperature=1.0, seed=2, n=3,
            extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-[0-9]{2}"}})
        assert all(re.fullmatch(r"[A-Z]{3}-[0-9]{2}", c.text) for c in regex.choices)
        choice = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
            extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
        assert choice.choices[0].message.content in ("sunny", "rainy")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex", "unclosed"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar",
     "nothing_here"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "object"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
])
def test_bad_constraints_are_400s(tiny_model_dir: Path, body: dict[str, Any], param: str,
                                  message: str) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5,
                                           extra_body=body)
        assert bad.value.body["param"] == param
        assert message in bad.value.body["message"]


def test_tools_on_completions_are_refused_by_name(tiny_model_dir: Path) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2,
                                      extra_body={"tools": [WEATHER]})
        assert bad.value.body["param"] == "tools"


def test_qwen3_style_multi_turn_with_a_tool_message(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "qwen3", arch="qwen3")
    (model_dir / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    bias = _bias(model_dir)
    with live_server(lambda: tiny_app(model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        first = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, max_tokens=120, temperature=0, logit_bias=bias)
        call = (first.choices[0].message.tool_calls or [])[0]
        turns: list[Any] = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"temperature": 21})}]
        second = client.chat.completions.create(
            model=MODEL_NAME, messages=turns, tools=[WEATHER], max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
        assert second.choices[0].finish_reason in ("length", "tool_calls", "stop")
        assert second.usage is not None and first.usage is not None
        # the second prompt holds the first: the call, as the template writes it, and the result
        tokenizer = Tokenizer.from_dir(model_dir)
        text = tokenizer.apply_chat_template(
            [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments)}}]},
             {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}],
            tools=[WEATHER])
        assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
        assert f'"name": "{call.function.name}"' in text and "# Tools" in text
        assert second.usage.prompt_tokens == len(tokenizer.encode(text))


def test_beam_search_with_a_choice_constraint(tiny_model_dir: Path) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        done = client.completions.create(
            model=MODEL_NAME, prompt="Pick:", max_tokens=8, n=2,
            extra_body={"use_beam_search": True,
                        "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
        assert {c.text for c in done.choices} <= {"alpha", "beta", "gamma"}
        assert len(done.choices) == 2

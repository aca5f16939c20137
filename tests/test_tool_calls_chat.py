"""Tool calls on chat completions, for every tool format and tool_choice: streamed and whole
greedy answers equal (cut by length too), no empty deltas, content's blanks the same both ways;
$defs / $ref and sets in tools' parameters and response formats (the corpus below), and a
response format with tools under "auto". Regression tests for the defects of the tool layer."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pydantic
import pytest

from kvcore.model.tokenizer import Tokenizer
from kvcore.service.schema_check import violations
from service_fixtures import MODEL_NAME, tiny_app, wait_pool_idle
from service_live import live_server
from tiny_model import make_tiny_model
from tool_templates import LLAMA3_STYLE_TEMPLATE, QWEN3_STYLE_TEMPLATE

ENGINE = {"max_model_len": 2048, "num_blocks": 2048, "max_num_batched_tokens": 1024}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _fn(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# schemas as clients send them: pydantic's $defs / $ref, nesting, enums, arrays, sets
CORPUS = [
    _fn("defs", {"type": "object", "$defs": {"who": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}}, "required": ["name"],
        "additionalProperties": False}}, "properties": {"who": {"$ref": "#/$defs/who"}},
        "required": ["who"], "additionalProperties": False}),
    _fn("nested", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}),
    _fn("enums", {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
                  "required": ["unit"], "additionalProperties": False}),
    _fn("arrays", {"type": "object", "properties": {"xs": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 3}}, "required": ["xs"], "additionalProperties": False}),
    _fn("sets", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True, "maxItems": 2}},
        "required": ["tags"], "additionalProperties": False}),
]


def _model(tmp_path: Path, fmt: str) -> Path:
    model_dir = make_tiny_model(tmp_path / fmt, max_position_embeddings=2048)
    template = {"hermes": QWEN3_STYLE_TEMPLATE, "llama3_json": LLAMA3_STYLE_TEMPLATE}.get(fmt)
    if template is not None:
        (model_dir / "chat_template.jinja").write_text(template)
    return model_dir


def _bias(model_dir: Path) -> dict[str, int]:
    tokenizer = Tokenizer.from_dir(model_dir)
    bias = {str(tokenizer.encode(c)[0]): b for c, b in (('"', 9), ("}", 6), ("]", 6))}
    return bias | {str(tokenizer.eos_token_id): 6}


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) folded from the stream; every chunk
    carries something (no empty `delta: {}` before the last)."""
    content, calls, finish = "", {}, ""  # type: ignore[var-annotated]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            assert delta or choice.finish_reason, chunk
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                call = calls.setdefault(item.index, ["", ""])
                call[0] = call[0] or (item.function.name or "")
                call[1] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(c) for c in calls.values()], finish  # type: ignore[misc]


@pytest.mark.parametrize("fmt", ["fallback", "hermes", "llama3_json"])
def test_streamed_equals_whole_for_every_tool_choice(tmp_path: Path, fmt: str) -> None:
    model_dir = _model(tmp_path, fmt)
    bias = _bias(model_dir)
    choices: list[Any] = ["auto", "required", {"type": "function",
                                               "function": {"name": "defs"}}]
    cut_calls = 0  # calls cut by length: the same partial arguments streamed and whole
    with live_server(lambda: tiny_app(model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for choice in choices:
            max_tokens, cut = 120, False
            while True:  # a whole answer, then the same cut by length 4 tokens before its end
                kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": CORPUS[:2],
                          "tool_choice": choice, "max_tokens": max_tokens, "temperature": 0,
                          "logit_bias": bias}
                done = client.chat.completions.create(**kwargs)
                whole = done.choices[0]
                content, calls, finish = _streamed(client, **kwargs)
                assert (content or None) == whole.message.content, (choice, max_tokens)
                assert calls == [(c.function.name, c.function.arguments)
                                 for c in whole.message.tool_calls or []], (choice, max_tokens)
                assert finish == whole.finish_reason
                if choice != "auto":
                    assert calls and all("<tool_call>" not in a for _, a in calls)
                    assert finish == ("length" if cut else "tool_calls")
                    cut_calls += cut
                if finish == "tool_calls":
                    tools = {t["function"]["name"]: t["function"]["parameters"] for t in CORPUS}
                    for name, arguments in calls:
                        jsonschema.validate(json.loads(arguments), tools[name])
                assert done.usage is not None
                if cut or done.usage.completion_tokens < 8:
                    break
                max_tokens, cut = done.usage.completion_tokens - 4, True
        assert cut_calls > 0
        assert server.app is not None
        server.call(wait_pool_idle(server.app))


class Tagged(pydantic.BaseModel):
    tags: set[str]
    who: list[Tagged] = []


def test_schema_corpus_under_every_tool_choice_and_parse(tiny_model_dir: Path) -> None:
    bias = _bias(tiny_model_dir)
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for tool in CORPUS:
            name = tool["function"]["name"]
            for choice in ("required", {"type": "function", "function": {"name": name}}):
                done = client.chat.completions.create(
                    model=MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice=choice,
                    max_tokens=120, temperature=0, logit_bias=bias,
                    parallel_tool_calls=False).choices[0]
                assert done.finish_reason == "tool_calls", (name, done)
                call = (done.message.tool_calls or [])[0]
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, tool["function"]["parameters"]
                                    | {"uniqueItems": False})
        # a pydantic model with a set (uniqueItems) and a recursive $ref parses
        parsed = client.chat.completions.parse(
            model=MODEL_NAME, messages=MESSAGES, response_format=Tagged, max_tokens=120,
            temperature=0, logit_bias=bias)
        assert isinstance(parsed.choices[0].message.parsed, Tagged)


def test_response_format_with_tools_under_auto(tiny_model_dir: Path) -> None:
    bias = _bias(tiny_model_dir)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for seed in range(3):
            done = client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=CORPUS[:1], response_format=fmt,
                max_tokens=120, temperature=1.0, seed=seed, logit_bias=bias).choices[0]
            if done.message.tool_calls:  # a call, or the format's JSON answer
                assert done.finish_reason == "tool_calls"
            else:
                jsonschema.validate(json.loads(done.message.content or ""), schema)
        with pytest.raises(openai.BadRequestError) as bad:  # no answer but calls: refused
            client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, tools=CORPUS[:1], response_format=fmt,
                tool_choice="required", max_tokens=4)
        assert bad.value.body["param"].startswith("response_format")  # type: ignore[index]


def test_unenforced_keywords_are_checked_after_generation() -> None:
    schema = {"type": "object", "$defs": {"tags": {"type": "array", "uniqueItems": True}},
              "properties": {"a": {"$ref": "#/$defs/tags"}, "b": {"type": "array", "items": {
                  "type": "object", "dependentRequired": {"x": ["y"]}}}}}
    assert violations(schema, {"a": [1, 2], "b": [{"x": 1, "y": 2}]}) == []
    assert violations(schema, {"a": [1, 1], "b": [{"x": 1}]}) == [
        "$.a: uniqueItems", "$.b[0]: dependentRequired"]


def test_a_broken_set_is_counted(tiny_model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a"]}, "uniqueItems": True, "minItems": 2,
        "maxItems": 2}}, "required": ["tags"], "additionalProperties": False}
    with live_server(lambda: tiny_app(tiny_model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for stream in (False, True):  # the only instance decoding allows repeats "a"
            out = client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                stream=stream, response_format={"type": "json_schema", "json_schema": {
                    "name": "s", "schema": schema}})
            if stream:
                list(out)  # type: ignore[arg-type]
        with urllib.request.urlopen(f"{server.url}/metrics") as resp:
            metrics = resp.read().decode()
        assert 'kvcore:structured_output_unenforced_violations_total{model_name="tiny"} 2.0' in (
            metrics), metrics

"""Llama 3.1's JSON tool calls: the format found from the template, the stream parser against the
whole-answer parser, "auto" constraining an answer that starts with `{`, and through the official
`openai` client against a live server with a Llama 3.1-style template: "required" (streamed and
not) and a named function parse and validate, a multi-turn exchange with a `tool` message
renders."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from tokenizers import Tokenizer as HFTokenizer

from engine_helpers import allowed_tokens, make_engine
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling.masks import MaskFiller
from kvcore.service.tool_format import FALLBACK, HERMES, LLAMA3_JSON, tool_format
from kvcore.service.tool_llama3 import Llama3CallStream, llama3_constraint, parse_llama3
from kvcore.service.tools import parse_tools
from service_fixtures import MODEL_NAME, tiny_app
from service_live import live_server
from test_structured_service import ENGINE, MESSAGES, TIME, WEATHER, _accumulate, _bias
from tiny_model import CHATML_TEMPLATE, make_tiny_model
from tool_templates import LLAMA3_STYLE_TEMPLATE, QWEN3_STYLE_TEMPLATE

ANSWER = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
          '"celsius"}}; {"name":"get_time","parameters":{"zone":-3}} ')


def test_the_format_comes_from_the_template() -> None:
    assert tool_format(LLAMA3_STYLE_TEMPLATE) is LLAMA3_JSON
    assert tool_format(QWEN3_STYLE_TEMPLATE) is HERMES
    assert tool_format(CHATML_TEMPLATE) is FALLBACK and tool_format(None) is FALLBACK


def _streamed(answer: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    stream = Llama3CallStream()
    content, calls = "", {}  # type: ignore[var-annotated]
    for i, piece in enumerate(pieces):
        text, items = stream.feed(piece, i == len(pieces) - 1)
        content += text
        for item in items:
            call = calls.setdefault(item["index"], {"name": "", "arguments": ""})
            if "id" in item:
                assert not call["name"], "id and name come once, first"
                call["name"] = item["function"]["name"]
            call["arguments"] += item["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


@pytest.mark.parametrize("seed", range(20))
def test_stream_matches_the_whole_answer(seed: int) -> None:
    rng = random.Random(seed)
    for answer in (ANSWER, ANSWER.removeprefix("<|python_tag|>"), "Sunny {not a call}"):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, min(30, len(answer) - 1))))
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        content, calls = _streamed(answer, pieces)
        whole_content, whole_calls = parse_llama3(answer)
        assert (content.strip() or None) == whole_content
        assert calls == [(c["function"]["name"], c["function"]["arguments"])
                         for c in whole_calls]
    assert [json.loads(a) for _, a in _streamed(ANSWER, [ANSWER])[1]] == [
        {"city": "Paris", "unit": "celsius"}, {"zone": -3}]
    assert parse_llama3('{"name": "get_time", "parameters": {"zone": 1') == (
        '{"name": "get_time", "parameters": {"zone": 1', [])  # cut by max_tokens: content


def test_auto_is_text_or_a_call_that_starts_with_a_brace(tiny_model_dir: Path) -> None:
    req = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert req is not None
    engine = make_engine(tiny_model_dir)
    tokenizer, filler = engine.tokenizer, MaskFiller(engine.model_config.vocab_size)
    text = engine.constraints.matcher(llama3_constraint(req, tokenizer.token_to_id))
    for token_id in tokenizer.encode("\n It is {sunny}"):  # free text may hold braces later
        assert not text.consume(token_id)
    assert tokenizer.eos_token_id in allowed_tokens(filler, text)
    blank = engine.constraints.matcher(llama3_constraint(req, tokenizer.token_to_id))
    blank.consume(tokenizer.encode("\n")[0])
    assert tokenizer.encode("{")[0] not in allowed_tokens(filler, blank)  # a call starts the answer
    call = engine.constraints.matcher(llama3_constraint(req, tokenizer.token_to_id))
    forced = '{"name":"get_weather","parameters":{"city":"'
    ids = tokenizer.encode(forced)
    assert ids[0] in allowed_tokens(filler, call)
    call.consume(ids[0])
    for token_id in ids[1:]:  # once "{" starts it, the call's head is forced
        assert allowed_tokens(filler, call) == {token_id}
        call.consume(token_id)
    assert len(allowed_tokens(filler, call)) > 100  # inside the city string
    for token_id in tokenizer.encode('Rome","unit":"celsius"}'):
        assert not call.consume(token_id)
    assert allowed_tokens(filler, call) == set(tokenizer.encode("}"))  # the call object closes


def test_a_call_may_follow_the_python_tag(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tagged", vocab_size=260)
    vocab = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab.add_special_tokens(["<|python_tag|>"])
    vocab.save(str(model_dir / "tokenizer.json"))
    req = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert req is not None
    engine = make_engine(model_dir)
    tokenizer, filler = engine.tokenizer, MaskFiller(engine.model_config.vocab_size)
    tag = tokenizer.token_to_id("<|python_tag|>")
    assert tag == 259
    matcher = engine.constraints.matcher(llama3_constraint(req, tokenizer.token_to_id))
    assert tag in allowed_tokens(filler, matcher)
    assert not matcher.consume(tag)
    assert allowed_tokens(filler, matcher) == set(tokenizer.encode("{"))  # a call, nothing else
    plain = engine.constraints.matcher(llama3_constraint(req, tokenizer.token_to_id))
    plain.consume(tokenizer.encode("A")[0])
    assert tag not in allowed_tokens(filler, plain)  # not inside text


def test_llama3_style_required_stream_and_multi_turn(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "llama3")
    (model_dir / "chat_template.jinja").write_text(LLAMA3_STYLE_TEMPLATE)
    bias = _bias(model_dir)
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    with live_server(lambda: tiny_app(model_dir, ENGINE)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MESSAGES, "seed": 1,
                                  "tools": [WEATHER, TIME], "tool_choice": "required",
                                  "max_tokens": 120, "temperature": 1.0, "logit_bias": bias}
        done = client.chat.completions.create(**kwargs)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name]["function"]["parameters"])
        streamed, finish, content = _accumulate(client.chat.completions.create(
            **kwargs, stream=True))
        assert finish == "tool_calls" and not content.strip()
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]

        named = client.chat.completions.create(**{
            **kwargs, "parallel_tool_calls": False, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        calls = named.choices[0].message.tool_calls
        assert calls and len(calls) == 1 and calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(calls[0].function.arguments),
                            TIME["function"]["parameters"])

        call = choice.message.tool_calls[0]
        turns: list[Any] = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
        second = client.chat.completions.create(
            model=MODEL_NAME, messages=turns, tools=[WEATHER], max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
        assert second.usage is not None
        tokenizer = Tokenizer.from_dir(model_dir)
        text = tokenizer.apply_chat_template(
            [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {
                    "name": call.function.name,
                    "arguments": json.loads(call.function.arguments)}}]},
             {"role": "tool", "content": '{"temperature": 21}'}], tools=[WEATHER])
        assert '<|im_start|>ipython\n{"temperature": 21}<|im_end|>' in text
        assert f'{{"name": "{call.function.name}", "parameters": {{' in text
        assert second.usage.prompt_tokens == len(tokenizer.encode(text))

"""Tool calls without a server: the stream parser against the whole-answer parser, the fallback
rendering for templates without tool support, and "auto" constraining a call once it starts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from engine_helpers import allowed_tokens, make_engine, random_prompts, run_all
from kvcore.sampling import SamplingParams
from kvcore.sampling.masks import MaskFiller
from kvcore.service.tool_stream import ToolCallStream
from kvcore.service.tools import (
    call_text,
    parse_calls,
    parse_tools,
    render_messages,
    tool_constraint,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
    "required": ["city"], "additionalProperties": False}}}
ANSWER = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo <x>"}}'
          '\n</tool_call>')


@pytest.mark.parametrize("seed", range(20))
def test_stream_matches_the_whole_answer(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(ANSWER)), rng.randint(1, 40)))
    pieces = [ANSWER[a:b] for a, b in zip([0, *cuts], [*cuts, len(ANSWER)], strict=True)]
    stream = ToolCallStream()
    content, calls = "", {}  # type: ignore[var-annotated]
    for i, piece in enumerate(pieces):
        text, items = stream.feed(piece, i == len(pieces) - 1)
        content += text
        for item in items:
            call = calls.setdefault(item["index"], {"name": "", "arguments": ""})
            if "id" in item:
                call["name"] = item["function"]["name"]
            call["arguments"] += item["function"]["arguments"]
    whole_content, whole_calls = parse_calls(ANSWER)
    assert content.strip() == whole_content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Oslo <x>"]


def test_text_that_only_looks_like_a_tag_is_content() -> None:
    stream = ToolCallStream()
    assert stream.feed("a <tool", False) == ("a ", [])
    assert stream.feed("box> b", True) == ("<toolbox> b", [])


def test_fallback_rendering_describes_tools_and_writes_calls_as_text() -> None:
    req = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out, tools = render_messages(messages, req, native=False)
    assert tools is None
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert out[2]["content"] == call_text("get_weather", {"city": "Rome"})
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    native, tools = render_messages(messages, req, native=True)
    assert tools == [WEATHER] and native[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Rome"}


def test_auto_constrains_a_call_once_it_starts(tiny_model_dir: Path) -> None:
    req = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    assert req is not None
    engine = make_engine(tiny_model_dir)
    tokenizer = engine.tokenizer
    filler = MaskFiller(engine.model_config.vocab_size)
    matcher = engine.constraints.matcher(tool_constraint(req))
    for token_id in tokenizer.encode("Hi there, <tool_call>"):
        assert not matcher.consume(token_id)  # free text, then the trigger
    forced = '\n{"name": "get_weather", "arguments": {"city":"'
    for token_id in tokenizer.encode(forced):  # the call's head is forced, token by token
        assert allowed_tokens(filler, matcher) == {token_id}
        matcher.consume(token_id)
    assert len(allowed_tokens(filler, matcher)) > 100  # inside the city string
    for token_id in tokenizer.encode('Rome"'):
        matcher.consume(token_id)
    assert allowed_tokens(filler, matcher) == set(tokenizer.encode("}"))  # no other property
    # free text alone (no trigger) is a complete answer too
    outputs = run_all(engine, random_prompts(8, 2), SamplingParams(
        max_tokens=12, temperature=1.0, seed=5, constraint=tool_constraint(req)))
    assert all(parse_calls(o.outputs[0].text)[1] == [] for o in outputs)

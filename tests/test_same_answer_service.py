"""The two reports behind "same request, same answer", through a live server and the official
`openai` client on the default model (GGUF q4 weights, fp16 cache): one client asking the same
greedy chat question twice (the first time cold, the second with its prefix cached) and the
same tool call twice get identical answers, logprobs included."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.engine import AsyncEngine, Engine
from kvcore.kernels.cpu import jit
from kvcore.service import make_app
from service_live import LiveServer, live_server

pytestmark = pytest.mark.skipif(not jit.active(),
                                reason="the promise is the compiled CPU kernels'")

MODEL = "smollm2"
SYSTEM = ("You are a careful assistant. Answer questions about science, history and geography "
          "in one or two sentences, give numbers with their units, and never make up facts. If "
          "a question is ambiguous, answer the most common reading of it. Keep answers short, "
          "plain and friendly, without lists unless the user asks for one. ") * 2
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(default_model_dir: Path) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(default_model_dir), device="cpu",
                          cache=CacheConfig(num_blocks=512),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=2048))
    with live_server(lambda: make_app(AsyncEngine(Engine(config)),
                                      served_model_name=MODEL)) as live:
        yield live


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def logprobs(choice) -> list:  # type: ignore[no-untyped-def]
    return [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
            for t in choice.logprobs.content]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 5}])
def test_same_question_twice(server: LiveServer, sampling: dict) -> None:
    salt = uuid.uuid4().hex  # a tenant of its own: the first request finds nothing cached
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the boiling point of water?"}]
    answers = [client(server).chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=24, logprobs=True,
        top_logprobs=3, extra_body={"cache_salt": salt}, **sampling) for _ in range(2)]
    cold, warm = (a.usage.prompt_tokens_details.cached_tokens for a in answers)
    assert cold == 0 and warm >= answers[0].usage.prompt_tokens - 16  # all but the last block
    first, second = (a.choices[0] for a in answers)
    assert second.message.content == first.message.content
    assert logprobs(second) == logprobs(first)


def test_same_tool_call_twice(server: LiveServer) -> None:
    salt = uuid.uuid4().hex
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the weather like in Paris and in Rome?"}]
    answers = [client(server).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
        max_completion_tokens=64, temperature=0.0, extra_body={"cache_salt": salt})
        for _ in range(2)]
    assert answers[1].usage.prompt_tokens_details.cached_tokens > 0
    first, second = ([(call.function.name, call.function.arguments)
                      for call in a.choices[0].message.tool_calls] for a in answers)
    assert first and second == first
    assert answers[1].choices[0].finish_reason == answers[0].choices[0].finish_reason

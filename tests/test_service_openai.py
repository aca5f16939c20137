"""The official `openai` client against a live kvcore server on loopback."""

from __future__ import annotations

import openai
import pytest

from service_fixtures import MODEL_NAME, tiny_app, wait_pool_idle
from service_live import live_server

MESSAGES = [{"role": "user", "content": "Say something."}]


def test_openai_client_round_trips(tiny_model_dir) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, api_keys=["sk-test"])) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-test", max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL_NAME]

        done = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6,
                                          temperature=0, logprobs=2,
                                          extra_body={"ignore_eos": True})
        choice = done.choices[0]
        assert choice.finish_reason == "length" and done.usage.completion_tokens == 6
        assert len(choice.logprobs.token_logprobs) == 6 and len(choice.logprobs.top_logprobs) == 6
        stream = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=6,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
        assert chunks[-1].usage.completion_tokens == 6
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0

        chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, seed=3,
                                              max_completion_tokens=5, logprobs=True,
                                              top_logprobs=2, extra_body={"ignore_eos": True})
        assert [c.index for c in chat.choices] == [0, 1]
        assert all(c.message.role == "assistant" for c in chat.choices)
        assert all(len(c.logprobs.content) == 5 for c in chat.choices)
        assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2
        assert chat.usage.completion_tokens == 10
        stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2,
                                                seed=3, max_completion_tokens=5, stream=True,
                                                extra_body={"ignore_eos": True})
        texts = ["", ""]
        for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert texts == [c.message.content for c in chat.choices]  # same seed, same choices

        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                          max_retries=0).models.list()
        assert server.app is not None
        server.call(wait_pool_idle(server.app))


@pytest.mark.asyncio
async def test_async_openai_client(tiny_model_dir) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir)) as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                      max_tokens=4, stream=True, temperature=0,
                                                      extra_body={"ignore_eos": True})
        finish = [c.choices[0].finish_reason async for c in stream if c.choices]
        assert finish[-1] == "length" and finish.count("length") == 1
        await client.close()

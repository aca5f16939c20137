"""Hypothesis-generated JSON bodies against the live HTTP surface: no 5xx, no leak, still up."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service_fixtures import tiny_app, wait_pool_idle
from service_live import LiveServer, live_server

EXAMPLES = int(os.environ.get("KVCORE_FUZZ_EXAMPLES", "100"))
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "min_tokens",
          "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "n",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "ignore_eos", "echo", "user", "priority",
          "cache_salt", "stream", "stream_options", "use_beam_search", "length_penalty",
          "early_stopping", "skip_special_tokens", "include_stop_str_in_output", "tokens",
          "add_generation_prompt", "response_format"]
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 300),
                    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
# values that are often valid, so requests also get past validation into the engine
plausible: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.one_of(st.text(min_size=0, max_size=30), st.lists(st.integers(-1, 300),
                                                                    max_size=8)),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system", "bot"]),
        "content": st.one_of(st.text(max_size=20), st.none(), st.integers())}), max_size=3),
    "max_tokens": st.integers(-1, 40), "n": st.integers(0, 4), "stream": st.booleans(),
    "temperature": st.floats(-0.5, 3), "logprobs": st.one_of(st.booleans(), st.integers(-1, 6)),
    "use_beam_search": st.booleans(), "stop": st.one_of(st.text(max_size=3),
                                                        st.lists(st.text(max_size=3),
                                                                 max_size=3)),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries(
        {"include_usage": st.booleans()})),
    "tokens": st.lists(st.integers(-2, 300), max_size=6),
}
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda base: st.fixed_dictionaries({k: v for k, v in plausible.items()
                                        if k in base or k in ("prompt", "messages")}).map(
        lambda good: base | good))


def _send(server: LiveServer, path: str, raw: bytes, accept: str) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path, raw, {
        "Content-Type": "application/json", "Accept": accept})
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_fuzz_http_surface(tiny_model_dir) -> None:
    with live_server(lambda: tiny_app(tiny_model_dir, max_body_size=1 << 16)) as server:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(path=st.sampled_from(PATHS), body=st.one_of(bodies, json_values),
               accept=st.sampled_from(["application/json", "application/x-msgpack"]),
               mangle=st.sampled_from([None, "truncate", "garbage"]))
        def check(path: str, body: Any, accept: str, mangle: str | None) -> None:
            raw = json.dumps(body).encode()  # NaN/Infinity go out as JSON extensions
            if mangle == "truncate":
                raw = raw[: len(raw) // 2]
            elif mangle == "garbage":
                raw = b"\xff" + raw
            status, answer = _send(server, path, raw, accept)
            assert status < 500, (status, answer[:300])
            if status >= 400:
                error = json.loads(answer)["error"]
                assert set(error) == {"message", "type", "param", "code"}
            # an error after the headers travels in the stream: never a server fault either
            assert b'"code":500' not in answer and b"InternalServerError" not in answer

        check()
        status, _ = _send(server, "/v1/completions", b'{"prompt": "still up", "max_tokens": 2}',
                          "application/json")
        assert status == 200
        assert server.app is not None
        server.call(wait_pool_idle(server.app))  # no request left holding blocks

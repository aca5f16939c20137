"""Request parsing (OpenAI/vLLM names, 400s naming the param), tenant salts, framing, metrics."""

from __future__ import annotations

import json
import math
import struct

import msgpack
import pytest

from kvcore.sampling.params import BeamSearchParams, SamplingParams
from kvcore.service.auth import TenantAuth, keys_from_list, read_keys_file
from kvcore.service.errors import APIError
from kvcore.service.metrics import ServiceMetrics
from kvcore.service.protocol import parse_chat, parse_completion
from kvcore.service.streaming import msgpack_frame, sse_event

VOCAB = 259


def _err(fn, body) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body, VOCAB)
    assert info.value.status == 400
    return info.value


def completion(body: dict, vocab_size: int) -> object:
    """The service's translation of a completions body into the engine's params (where the
    sampling ranges are checked)."""
    return parse_completion(body, vocab_size).params


def chat(body: dict, vocab_size: int) -> object:
    return parse_chat(body, vocab_size).params


def test_completion_fields_map_to_sampling_params() -> None:
    req = parse_completion({
        "prompt": "hi", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
        "min_p": 0.1, "seed": -3, "stop": "x", "stop_token_ids": [2], "min_tokens": 1, "n": 2,
        "logprobs": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.2, "logit_bias": {"7": 5.5}, "ignore_eos": True,
        "user": "u", "priority": -4, "cache_salt": "s", "skip_special_tokens": False,
        "include_stop_str_in_output": True, "unknown_field": {"ignored": True}}, VOCAB)
    params = req.params
    assert isinstance(params, SamplingParams)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 5)
    assert (params.min_p, params.seed, params.stop, params.stop_token_ids) == (0.1, -3, ("x",),
                                                                                (2,))
    assert (params.n, params.logprobs, params.min_tokens, params.ignore_eos) == (2, 3, 1, True)
    assert params.logit_bias == {7: 5.5}
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5, -0.5, 1.2)
    assert not params.skip_special_tokens and params.include_stop_str_in_output
    assert (req.priority, req.cache_salt, req.user) == (-4, "s", "u")


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_off(top_k: int) -> None:
    req = parse_completion({"prompt": "a", "top_k": top_k}, VOCAB)
    assert req.params.top_k is None  # type: ignore[union-attr]


def test_prompt_forms() -> None:
    assert parse_completion({"prompt": [5, 6.0]}, VOCAB).prompts == [[5, 6]]
    assert parse_completion({"prompt": ["a", "b"]}, VOCAB).prompts == ["a", "b"]
    assert parse_completion({"prompt": [[1], [2, 3]]}, VOCAB).prompts == [[1], [2, 3]]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "a", "temperature": -0.1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": 1e400}, "temperature"),
    ({"prompt": "a", "temperature": math.nan}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "top_k": 1.5}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 10**6}, "n"),
    ({"prompt": "a", "use_beam_search": True, "n": 0}, "n"),  # the beam width, by its body name
    ({"prompt": "a", "use_beam_search": True, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "a", "use_beam_search": True, "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "seed": "1"}, "seed"),
    ({"prompt": "a", "stop": [1]}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop_token_ids": "2"}, "stop_token_ids"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1]}, "logit_bias"),
    ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "stream": "true"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "cache_salt": ""}, "cache_salt"),
    ({"prompt": "a", "priority": 2**64}, "priority"),
    ({"prompt": "a", "user": 5}, "user"),
    ({"prompt": "a", "model": ["m"]}, "model"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
])
def test_completion_bad_values_name_their_param(body: dict, param: str) -> None:
    assert _err(completion, body).param == param


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a", "max_tokens": -3}, "max_tokens must be an integer >= 1, got -3"),  # no upper
    ({"prompt": "a", "n": 0}, "n must be an integer in [1, "),  # both bounds
    ({"prompt": "a", "seed": 2**70}, "seed must be a 64-bit integer, got "),  # only int64's
])
def test_integer_range_errors_say_the_bounds_that_apply(body: dict, message: str) -> None:
    assert _err(completion, body).message.startswith(message)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format"),
])
def test_chat_bad_values_name_their_param(body: dict, param: str) -> None:
    assert _err(chat, body).param == param


def test_chat_fields() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
                      "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
                      "top_logprobs": 2}, VOCAB)
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.params.max_tokens == 4 and req.params.logprobs == 2  # max_completion_tokens wins
    plain = parse_chat({"messages": [{"role": "user", "content": "x"}]}, VOCAB)
    assert plain.params.max_tokens is None


def test_max_tokens_is_passed_on_for_beams_too() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "x"}]}, VOCAB)
    assert req.params.max_tokens is None  # the engine fills the context
    beams = parse_chat({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True,
                        "n": 2}, VOCAB)
    assert beams.params.max_tokens is None and beams.params.num_seqs == 2


def test_beam_search_params() -> None:
    req = parse_completion({"prompt": "a", "use_beam_search": True, "n": 3, "max_tokens": 5,
                            "length_penalty": 0.5, "early_stopping": True}, VOCAB)
    params = req.params
    assert isinstance(params, BeamSearchParams)
    assert (params.beam_width, params.max_tokens, params.length_penalty) == (3, 5, 0.5)
    assert params.early_stopping is True
    req = parse_completion({"prompt": "a", "use_beam_search": True, "early_stopping": "never"},
                           VOCAB)
    assert req.params.early_stopping == "never"  # type: ignore[union-attr]
    with pytest.raises(APIError):
        parse_completion({"prompt": "a", "early_stopping": "sometimes"}, VOCAB)


def test_error_body_shape() -> None:
    body = _err(completion, {"prompt": "a", "top_p": 7}).body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400


def test_tenant_salts_isolate_and_request_salt_narrows(tmp_path) -> None:
    auth = TenantAuth({"ka": "A", "kb": "B"}, secret=b"s")
    assert auth.cache_salt("A", None) == TenantAuth({}, secret=b"s").cache_salt("A", None)
    assert auth.cache_salt("A", None) != auth.cache_salt("B", None)
    # a request salt never lands in another tenant's space, even a copied one
    assert auth.cache_salt("A", "x") != auth.cache_salt("B", "x")
    assert auth.cache_salt("A", "x") not in {auth.cache_salt("A", None),
                                              auth.cache_salt("B", None)}
    assert auth.cache_salt("A", auth.cache_salt("B", None)) != auth.cache_salt("B", None)
    assert TenantAuth({}).cache_salt("A", None) != TenantAuth({}).cache_salt("A", None)
    assert keys_from_list(["k1", "k2"]) == {"k1": "key0", "k2": "key1"}
    (tmp_path / "keys.txt").write_text("# comment\nk1 alice\n\nk2 bob\n")
    assert read_keys_file(tmp_path / "keys.txt") == ({"k1": "alice", "k2": "bob"}, set())
    (tmp_path / "keys.json").write_text(json.dumps({"k3": "carol"}))
    assert read_keys_file(tmp_path / "keys.json") == ({"k3": "carol"}, set())
    (tmp_path / "bad.txt").write_text("k1\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        read_keys_file(tmp_path / "bad.txt")


def test_framing() -> None:
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    frame = msgpack_frame({"token_ids": [1, 2], "text": "hé", "finish_reason": None})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert msgpack.unpackb(frame[4:]) == {"token_ids": [1, 2], "text": "hé",
                                          "finish_reason": None}


def test_metrics_names() -> None:
    class Stats:
        num_running, num_waiting, kv_cache_usage, num_free_blocks = 2, 3, 0.25, 30
        prefix_cache_queries, prefix_cache_hits, num_preemptions = 64, 16, 1
        block_size, cache_dtype, num_blocks = 16, "fp32", 40

    metrics = ServiceMetrics("m", lambda: Stats())
    metrics.observe_token_gap(0.02)

    class Timings:
        arrival_time, first_scheduled_time, first_token_time, finished_time = 1.0, 1.5, 2.0, 3.0

    metrics.observe_request(5, 7, ["stop", "length"], Timings())
    text = metrics.render().decode()
    for line in ['kvcore:num_requests_running{model_name="m"} 2.0',
                 'kvcore:num_requests_waiting{model_name="m"} 3.0',
                 'kvcore:kv_cache_usage_perc{model_name="m"} 0.25',
                 'kvcore:prefix_cache_queries_total{model_name="m"} 64.0',
                 'kvcore:prefix_cache_hits_total{model_name="m"} 16.0',
                 'kvcore:num_preemptions_total{model_name="m"} 1.0',
                 'kvcore:prompt_tokens_total{model_name="m"} 5.0',
                 'kvcore:generation_tokens_total{model_name="m"} 7.0',
                 'kvcore:request_success_total{finished_reason="stop",model_name="m"} 1.0',
                 'kvcore:time_to_first_token_seconds_sum{model_name="m"} 1.0',
                 'kvcore:e2e_request_latency_seconds_sum{model_name="m"} 2.0',
                 'kvcore:request_queue_time_seconds_sum{model_name="m"} 0.5',
                 'kvcore:inter_token_latency_seconds_count{model_name="m"} 1.0',
                 ('kvcore:cache_config_info{block_size="16",cache_dtype="fp32",'
                  'num_blocks="40"} 1.0')]:
        assert line in text, line

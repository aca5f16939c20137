"""Parsing and validating /v1/completions and /v1/chat/completions bodies (OpenAI/vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvcore.sampling.params import (
    LENGTH_PENALTY_RANGE,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
)
from kvcore.service.errors import bad_request
from kvcore.service.fields import (
    as_int,
    get_bool,
    get_float,
    get_int,
    get_logit_bias,
    get_object,
    get_stop,
    get_str,
    get_token_ids,
)
from kvcore.service.structured import parse_constraint
from kvcore.service.tools import ToolRequest, parse_tools, tool_constraint

MAX_PROMPTS = 256  # prompts of one batched completions request
MAX_USER_CHARS = 256  # the `user` field: an end-user id, echoed into the request log
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# OpenAI (and vLLM) fields kvcore does not implement: refused by name rather than ignored, so a
# client never gets a different behaviour than it asked for. A value equal to the default passes.
UNSUPPORTED: dict[str, Any] = {
    "functions": (None, []), "function_call": (None, "none"), "suffix": (None, ""),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "prompt_logprobs": (None,), "allowed_token_ids": (None,),
    "bad_words": (None, []), "logits_processors": (None,),
}
# chat only: a completions body with these is refused by name
CHAT_ONLY: dict[str, Any] = {"tools": (None, []), "tool_choice": (None, "none", "auto"),
                             "parallel_tool_calls": (None, True, False)}

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    kind: Literal["completion", "chat"]
    model: str | None
    prompts: list[Prompt]  # completions: one or more; chat: empty (see messages)
    messages: list[dict[str, Any]]  # chat only
    add_generation_prompt: bool
    n: int
    max_tokens: int | None  # None: up to max_model_len
    max_tokens_param: str  # the body's name for it (chat: max_completion_tokens wins)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields but max_tokens
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # the top-k to report with each token; None: no logprobs
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    tools: ToolRequest | None = None  # chat with tools (tool_choice other than "none")


def _prompts(body: dict[str, Any], vocab_size: int) -> list[Prompt]:
    raw = body.get("prompt")
    if raw is None:
        raise bad_request("prompt is required", "prompt")
    # str | list[int] | list[str] | list[list[int]], as the OpenAI API accepts
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(
            isinstance(t, int | float) and not isinstance(t, bool) for t in raw):
        items = [raw]
    elif isinstance(raw, list):
        items = raw
    else:
        raise bad_request("prompt must be a string, an array of strings or an array of token ids",
                          "prompt")
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    prompts: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be empty", "prompt")
            prompts.append(item)
        elif isinstance(item, list) and item:
            prompts.append([as_int(t, "prompt", 0, vocab_size - 1) for t in item])
        else:
            raise bad_request("each prompt must be a non-empty string or array of token ids",
                              "prompt")
    return prompts


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    messages = []
    for message in raw:
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(f"message role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                              "messages")
        content = message.get("content")
        if isinstance(content, list):
            # the content-parts form: only text parts can be served by a text model
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad_request("only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request("message content must be a string or an array of parts",
                              "messages")
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request("a tool message needs its tool_call_id (a string)", "messages")
            entry["tool_call_id"] = call_id
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            entry["tool_calls"] = _tool_calls(calls)
        messages.append(entry)
    return messages


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as the chat template reads them."""
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be an array", "messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str | dict)):
            raise bad_request("each tool call needs function.name and function.arguments",
                              "messages")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def _sampling(body: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    top_k = get_int(body, "top_k", None, -1)
    return {
        # their ranges are SamplingParams' (a 400 naming the field when it is built)
        "temperature": get_float(body, "temperature", 1.0),
        "top_p": get_float(body, "top_p", 1.0),
        # -1 and 0 mean "off" (vLLM); a k past the vocabulary keeps every token either way
        "top_k": None if top_k in (None, -1, 0) else min(top_k, vocab_size),
        "min_p": get_float(body, "min_p", 0.0, 0.0, 1.0),
        "seed": get_int(body, "seed", None),
        "presence_penalty": get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": get_float(body, "repetition_penalty", 1.0,
                                        *REPETITION_PENALTY_RANGE),
        "logit_bias": get_logit_bias(body, vocab_size),
        "stop": get_stop(body),
        "stop_token_ids": get_token_ids(body, "stop_token_ids", vocab_size),
        "ignore_eos": get_bool(body, "ignore_eos", False),
        "min_tokens": get_int(body, "min_tokens", 0, 0),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", False),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", True),
    }


def _early_stopping(body: dict[str, Any]) -> bool | Literal["never"]:
    # vLLM and transformers also accept "never" (score running beams at max_tokens)
    if body.get("early_stopping") == "never":
        return "never"
    return get_bool(body, "early_stopping", False)


def _refuse_unsupported(body: dict[str, Any], n: int) -> None:
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} is not supported by this server", name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(f"best_of must equal n ({n}) when set: kvcore returns every sequence "
                          f"it generates, got {best_of!r}", "best_of")


def check_prompt_chars(prompt: str | list[int], max_model_len: int, max_token_chars: int,
                       param: str) -> None:
    """A cheap bound before tokenizing: no token stands for more than `max_token_chars`
    characters, so a text longer than max_model_len of them can never fit (400)."""
    if isinstance(prompt, str) and len(prompt) > max_model_len * max_token_chars:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; "
                          f"the {param} has {len(prompt)} characters, more than any "
                          f"{max_model_len} tokens can hold", param)


def _common(body: dict[str, Any], kind: Literal["completion", "chat"], vocab_size: int,
            max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
            prompts: list[Prompt], messages: list[dict[str, Any]], echo: bool
            ) -> GenerationRequest:
    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    include_usage = get_bool(options or {}, "include_usage", False)
    sampling = _sampling(body, vocab_size)
    sampling["constraint"] = parse_constraint(body)
    tools = parse_tools(body) if kind == "chat" else None
    if tools is not None:
        if sampling["constraint"] is not None:
            raise bad_request("tools and a constrained response_format / structured_outputs "
                              "cannot be combined", sampling["constraint"].param)
        sampling["constraint"] = tool_constraint(tools)
    n = get_int(body, "n", 1)  # its range is SamplingParams' / BeamSearchParams'
    assert n is not None
    _refuse_unsupported(body, n)
    if kind == "completion":
        for name, allowed in CHAT_ONLY.items():
            if name in body and body[name] not in allowed:
                raise bad_request(f"{name} is only supported on /v1/chat/completions", name)
    return GenerationRequest(
        kind=kind,
        model=get_str(body, "model"),
        prompts=prompts,
        messages=messages,
        add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        n=n,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        sampling=sampling,
        use_beam_search=get_bool(body, "use_beam_search", False),
        length_penalty=get_float(body, "length_penalty", 1.0, *LENGTH_PENALTY_RANGE),
        early_stopping=_early_stopping(body),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        echo=echo,
        priority=get_int(body, "priority", 0) or 0,
        cache_salt=get_str(body, "cache_salt", non_empty=True),
        user=_user(body),
        tools=tools,
    )


def _user(body: dict[str, Any]) -> str | None:
    user = get_str(body, "user")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise bad_request(f"user must be at most {MAX_USER_CHARS} characters, got {len(user)}",
                          "user")
    return user


def parse_completion(body: dict[str, Any], vocab_size: int) -> GenerationRequest:
    prompts = _prompts(body, vocab_size)
    max_tokens = get_int(body, "max_tokens", 16)  # OpenAI's completions default
    logprobs = get_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo")
    return _common(body, "completion", vocab_size, max_tokens, "max_tokens", logprobs, prompts,
                   [], echo)


def parse_chat(body: dict[str, Any], vocab_size: int) -> GenerationRequest:
    messages = _messages(body)
    # max_completion_tokens is OpenAI's newer name; it wins over the deprecated max_tokens
    param = "max_completion_tokens"
    max_tokens = get_int(body, param, None)
    if max_tokens is None:
        param = "max_tokens"
        max_tokens = get_int(body, param, None)
    want_logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and top_logprobs > 0 and not want_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    echo = get_bool(body, "echo", False)
    return _common(body, "chat", vocab_size, max_tokens, param, logprobs, [], messages, echo)

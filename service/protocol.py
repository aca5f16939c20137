"""A /v1/completions or /v1/chat/completions body -> the engine's params and the prompts.

The body is read once: JSON types and OpenAI-only fields here, every sampling value's range in
SamplingParams / BeamSearchParams (its ParamError names the field, which becomes the 400's
`param`); the prompt against the context in the engine, when the request is added."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from kvcore.config import ParamError
from kvcore.sampling.params import BeamSearchParams, SamplingParams
from kvcore.service.errors import bad_request
from kvcore.service.fields import (
    as_int,
    get_bool,
    get_int,
    get_list,
    get_logit_bias,
    get_object,
    get_str,
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
class Call:
    """One API call, translated: the engine params of each of its prompts, and the options
    that shape the answer on the wire."""

    kind: Literal["completion", "chat"]
    model: str | None
    prompts: list[Prompt]  # completions: one or more; chat: empty (see messages)
    messages: list[dict[str, Any]]  # chat only
    add_generation_prompt: bool
    params: SamplingParams | BeamSearchParams
    fill_max_tokens: bool  # beams without max_tokens: the context's room (params_for)
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    user: str | None = None
    tools: ToolRequest | None = None  # chat with tools (tool_choice other than "none")

    @property
    def n(self) -> int:
        return self.params.n if isinstance(self.params, SamplingParams) else self.params.beam_width

    @property
    def logprobs(self) -> int | None:
        return self.params.logprobs if isinstance(self.params, SamplingParams) else None

    def params_for(self, num_prompt_tokens: int, max_model_len: int
                   ) -> SamplingParams | BeamSearchParams:
        """The params of one prompt: a beam search with no max_tokens fills the context."""
        if not self.fill_max_tokens:
            return self.params
        room = max(max_model_len - num_prompt_tokens, 1)
        return dataclasses.replace(self.params, max_tokens=room)


def _prompts(body: dict[str, Any]) -> list[Prompt]:
    raw = body.get("prompt")
    # str | list[int] | list[str] | list[list[int]], as the OpenAI API accepts
    if isinstance(raw, list) and raw and all(
            isinstance(t, int | float) and not isinstance(t, bool) for t in raw):
        raw = [raw]
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items or not all(
            isinstance(item, str | list) and item for item in items):
        raise bad_request("prompt must be a non-empty string, array of strings or array of "
                          "token ids (or an array of those)", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    # token ids against the vocabulary: the engine's check, when the request is added
    return [item if isinstance(item, str) else [as_int(t, "prompt") for t in item]
            for item in items]


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    messages = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(f"message role must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                              "messages")
        content = message.get("content")
        if isinstance(content, list):
            # the content-parts form: only text parts can be served by a text model
            if not all(isinstance(part, dict) and part.get("type") == "text"
                       and isinstance(part.get("text"), str) for part in content):
                raise bad_request("only text content parts are supported", "messages")
            content = "".join(part["text"] for part in content)
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
            entry["tool_calls"] = _tool_calls(calls, i)
        messages.append(entry)
    return messages


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as the chat template reads them."""
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments", "{}"), str | dict)):
            raise bad_request("each tool call needs function.name and function.arguments",
                              "messages")
        if isinstance(fn.get("arguments"), str):
            _check_arguments(fn["arguments"],
                             f"messages[{i}].tool_calls[{j}].function.arguments")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def _check_arguments(text: str, where: str) -> None:
    """A call's arguments: a JSON object as text, whose strings (once decoded) are valid
    Unicode: its escapes can spell a lone surrogate ("\\ud800") the body's check cannot see."""
    try:
        arguments = json.loads(text)
    except (ValueError, RecursionError):
        raise bad_request(f"{where} must be a JSON object string", "messages") from None
    try:
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{where} holds text that is not valid Unicode (a lone surrogate)",
                          "messages") from None


def _value(body: dict[str, Any], name: str, default: Any) -> Any:
    value = body.get(name)
    return default if value is None else value


def _sampling(body: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """SamplingParams' fields but n, max_tokens and logprobs, as the body gives them."""
    top_k = get_int(body, "top_k", None)
    return {
        "temperature": _value(body, "temperature", 1.0),
        "top_p": _value(body, "top_p", 1.0),
        # -1 and 0 mean "off" (vLLM); a k past the vocabulary keeps every token either way
        "top_k": None if top_k in (None, -1, 0) else min(top_k, vocab_size),
        "min_p": _value(body, "min_p", 0.0),
        "seed": get_int(body, "seed", None),
        "presence_penalty": _value(body, "presence_penalty", 0.0),
        "frequency_penalty": _value(body, "frequency_penalty", 0.0),
        "repetition_penalty": _value(body, "repetition_penalty", 1.0),
        "logit_bias": get_logit_bias(body),
        "stop": tuple(get_list(body, "stop", "a string or an array of strings")),
        "stop_token_ids": tuple(as_int(t, "stop_token_ids") for t in get_list(
            body, "stop_token_ids", "an array of token ids")),
        "ignore_eos": _value(body, "ignore_eos", False),
        "min_tokens": get_int(body, "min_tokens", 0),
        "include_stop_str_in_output": _value(body, "include_stop_str_in_output", False),
        "skip_special_tokens": _value(body, "skip_special_tokens", True),
        "constraint": parse_constraint(body),
    }


def _params(body: dict[str, Any], kind: str, vocab_size: int, max_tokens_param: str,
            max_tokens: int | None, logprobs: int | None, tools: ToolRequest | None
            ) -> tuple[SamplingParams | BeamSearchParams, bool]:
    """The engine params (and whether a beam search fills the context): a 400 naming the
    body's field when a value is out of its range."""
    sampling = _sampling(body, vocab_size)
    if tools is not None:
        if sampling["constraint"] is not None:
            raise bad_request("tools and a constrained response_format / structured_outputs "
                              "cannot be combined", sampling["constraint"].param)
        try:  # a combined grammar past the size bound names `tools`
            sampling["constraint"] = tool_constraint(tools)
        except ParamError as e:
            raise bad_request(str(e), e.param) from None
    n = get_int(body, "n", 1)
    beam = get_bool(body, "use_beam_search", False)
    if beam and logprobs is not None:
        raise bad_request("logprobs are not available with beam search", "logprobs")
    early_stopping = body.get("early_stopping")  # vLLM and transformers accept "never" too
    if early_stopping != "never":
        early_stopping = get_bool(body, "early_stopping", False)
    # the body's names of the params' fields: n is the beam width; chat's max_completion_tokens
    names = {"beam_width": "n", "max_tokens": max_tokens_param,
             "logprobs": "top_logprobs" if kind == "chat" else "logprobs"}
    try:
        params: SamplingParams | BeamSearchParams = SamplingParams(
            n=n, max_tokens=max_tokens, logprobs=logprobs, **sampling)
        if beam:  # max_tokens 1 until params_for fills the context's room
            params = BeamSearchParams(
                beam_width=n, max_tokens=max_tokens or 1,  # type: ignore[arg-type]
                length_penalty=_value(body, "length_penalty", 1.0),
                early_stopping=early_stopping, ignore_eos=sampling["ignore_eos"],
                stop_token_ids=sampling["stop_token_ids"], constraint=sampling["constraint"])
    except ParamError as e:
        raise bad_request(str(e), names.get(e.param, e.param)) from None
    return params, beam and max_tokens is None


def _call(body: dict[str, Any], kind: Literal["completion", "chat"], vocab_size: int,
          max_tokens_param: str, max_tokens: int | None, logprobs: int | None,
          prompts: list[Prompt], messages: list[dict[str, Any]], echo: bool) -> Call:
    stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options")
    if options is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    for name, allowed in UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"{name} is not supported by this server", name)
    if kind == "completion":
        for name, allowed in CHAT_ONLY.items():
            if name in body and body[name] not in allowed:
                raise bad_request(f"{name} is only supported on /v1/chat/completions", name)
    tools = parse_tools(body) if kind == "chat" else None
    params, fill = _params(body, kind, vocab_size, max_tokens_param, max_tokens, logprobs,
                           tools)
    call = Call(kind=kind, model=get_str(body, "model"), prompts=prompts, messages=messages,
                add_generation_prompt=get_bool(body, "add_generation_prompt", True),
                params=params, fill_max_tokens=fill, stream=stream,
                include_usage=get_bool(options or {}, "include_usage", False), echo=echo,
                priority=get_int(body, "priority", 0) or 0,
                cache_salt=get_str(body, "cache_salt", non_empty=True), user=_user(body),
                tools=tools)
    best_of = body.get("best_of")
    if best_of is not None and best_of != call.n:
        raise bad_request(f"best_of must equal n ({call.n}) when set: kvcore returns every "
                          f"sequence it generates, got {best_of!r}", "best_of")
    return call


def check_prompt_chars(prompt: str | list[int], max_model_len: int, max_token_chars: int,
                       param: str) -> None:
    """A cheap bound before tokenizing: no token stands for more than `max_token_chars`
    characters, so a text longer than max_model_len of them can never fit (400)."""
    if isinstance(prompt, str) and len(prompt) > max_model_len * max_token_chars:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens; "
                          f"the {param} has {len(prompt)} characters, more than any "
                          f"{max_model_len} tokens can hold", param)


def _user(body: dict[str, Any]) -> str | None:
    user = get_str(body, "user")
    if user is not None and len(user) > MAX_USER_CHARS:
        raise bad_request(f"user must be at most {MAX_USER_CHARS} characters, got {len(user)}",
                          "user")
    return user


def parse_completion(body: dict[str, Any], vocab_size: int) -> Call:
    prompts = _prompts(body)
    max_tokens = get_int(body, "max_tokens", 16)  # OpenAI's completions default
    logprobs = get_int(body, "logprobs", None)
    echo = get_bool(body, "echo", False)
    if echo and logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo")
    return _call(body, "completion", vocab_size, "max_tokens", max_tokens, logprobs, prompts,
                 [], echo)


def parse_chat(body: dict[str, Any], vocab_size: int) -> Call:
    messages = _messages(body)
    # max_completion_tokens is OpenAI's newer name; it wins over the deprecated max_tokens
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else (
        "max_tokens")
    want_logprobs = get_bool(body, "logprobs", False)
    top_logprobs = get_int(body, "top_logprobs", None)
    if top_logprobs is not None and top_logprobs > 0 and not want_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    return _call(body, "chat", vocab_size, param, get_int(body, param, None), logprobs, [],
                 messages, get_bool(body, "echo", False))

"""Reliability soak: a bounded mix of good, bad and abusive traffic against a live kvcore server.

The mix: streamed and plain completions and chat (n > 1, beam search, stop strings, logprobs,
batched prompts), clients that leave mid-stream or before the answer, bad requests (unsafe
parameter values, lone surrogates, wrong role types, gzip bodies, text/plain, unsupported OpenAI
fields, too many sequences, malformed JSON), raw-socket abuse (slowloris headers, a body shorter
than its Content-Length, a bad request line, a NUL in the Authorization header, ...), overload
bursts that must meet 429s, and an admission burst (long n=2 calls all at once: the server may
admit no more sequences than --max-waiting plus --max-num-seqs). Then it checks: 0 5xx
(statuses, in-stream error events and the request log), 0 hung requests, every stream
well-formed (ends with `data: [DONE]`, at most one error event and only last, every choice
finished once), 4xx bodies in OpenAI's error shape naming the parameter, /metrics idle (0
running, 0 waiting, every KV block free), and a server log of JSON lines only, with no traceback
and never the run's API key. Then the constraint phase (tools/soak_constraints.py): crash
shapes and unsatisfiable, mistyped or oversized constraints must be 400s naming the field with
the server answering after each, a plain stream's token gaps while large grammars compile must
stay within 2x its longest gap alone or while the same requests arrive compiled already (or
alone + 0.25 s; measured again once when a gap passes: a busy machine's hiccup rarely repeats, a
compile on the event loop always does), and the server's RSS must stay flat across unique
large schemas.

    flock /tmp/kvcore-bench.lock .venv/bin/python tools/soak.py --json soak.json
    .venv/bin/python tools/soak.py --url http://127.0.0.1:8000 --api-key KEY --log serve.log

Without --url it starts `kvcore serve` (the default model, or --model DIR) on a free loopback
port with small limits and a random API key, captures its log, checks the connection cap and
idle sockets (--max-connections silent sockets: the server must close them unanswered within
--header-timeout of their opening), and at the end sends SIGTERM while streams run: they must
end well-formed, the process with status 0.
Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import random
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any

import aiohttp

import soak_constraints as shapes

SERVE = [sys.executable, "-c", "import sys; from kvcore.cli import main; sys.exit(main())",
         "serve"]
ANY = "<any param>"  # an expected error whose `param` is not checked
DONE = b"data: [DONE]\n\n"
PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):",
           "List three colors:", "Water boils at", "My favourite book is", "In 1969, the first",
           "Translate to French: cheese")
STOPS = (".", "\n", " the", ",", "e")
# case kinds drawn for the rest of the plan, once every bad and raw case is in it
MIX = {"completion": 14, "completion_stream": 14, "chat": 10, "chat_stream": 10, "beam": 6,
       "disconnect": 8, "cancel_early": 3, "bad": 20, "raw": 4}
RETRIES_429 = 30  # an ordinary case retries a 429 this often (bursts never do)
LINGER_S = 10.0  # aiohttp reads a stalled body this long after answering before it closes
MAX_FAILURES = 40  # failure messages kept in the summary


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)  # by case kind
    statuses: Counter[str] = field(default_factory=Counter)  # by HTTP status
    streams: Counter[str] = field(default_factory=Counter)  # ok / malformed / error_event / ...
    hung: Counter[str] = field(default_factory=Counter)  # by case kind
    server_errors: int = 0  # 5xx statuses and 5xx error events, bar the connection cap's 503
    rate_limited: int = 0
    burst_429: int = 0
    admitted_seqs: list[int] = field(default_factory=list)  # per admission burst
    idle_sockets: dict[str, Any] = field(default_factory=dict)
    cap_503: dict[str, int] = field(default_factory=dict)  # 503s of the connection cap
    bad_429: set[str] = field(default_factory=set)  # bad requests answered 429 before their 4xx
    drain_finish: Counter[str] = field(default_factory=Counter)
    close_s: dict[str, float] = field(default_factory=dict)  # slow clients: slowest close
    health_s: list[float] = field(default_factory=list)  # /health answer times during the plan
    constraints: dict[str, Any] = field(default_factory=dict)  # the constraint phase's report
    failures: list[str] = field(default_factory=list)
    num_failures: int = 0

    def fail(self, kind: str, why: str) -> None:
        self.num_failures += 1
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(f"{kind}: {why}")

    def status(self, status: int | None) -> None:
        self.statuses[str(status)] += 1
        if status is not None and status >= 500 and status != 505:  # 505: the client's HTTP
            self.server_errors += 1


@dataclass
class Ctx:
    args: argparse.Namespace
    http: aiohttp.ClientSession
    url: str
    host: str
    port: int
    api_key: str | None
    model: str
    max_model_len: int
    tally: Tally = field(default_factory=Tally)
    burst_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers | (extra or {})


# ---- answers -------------------------------------------------------------------------------

def error_problem(raw: bytes, param: str | None = ANY) -> str | None:
    """None when `raw` is OpenAI's {"error": {message, type, param, code}} naming `param`."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return f"error body is not a JSON object: {raw[:100]!r}"
    if not (isinstance(err, dict) and isinstance(err.get("message"), str)
            and isinstance(err.get("type"), str) and "param" in err and "code" in err):
        return f"error body is not OpenAI's shape: {raw[:160]!r}"
    if param != ANY and err["param"] != param:
        return f"error names param {err['param']!r}, expected {param!r}: {err['message'][:120]}"
    return None


@dataclass
class Answer:
    problem: str | None = None
    texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # a stream's error event


def check_sse(raw: bytes, num_choices: int, chat: bool) -> Answer:
    """A stream is well-formed when it is `data: ` events ending with `data: [DONE]`, at most one
    error event and only last, and (without an error) every choice finished exactly once."""
    out = Answer()
    if not raw.endswith(DONE):
        out.problem = f"does not end with data: [DONE] (tail {raw[-80:]!r})"
        return out
    parts = raw[:-len(DONE)].split(b"\n\n")
    if parts[-1] != b"":
        out.problem = f"an event is not terminated by a blank line: {parts[-1][:80]!r}"
        return out
    try:
        for part in parts[:-1]:
            if not part.startswith(b"data: ") or part == b"data: [DONE]":
                raise ValueError(f"unexpected event {part[:80]!r}")
            event = json.loads(part[6:])
            if out.error is not None:
                raise ValueError("an event after the error event")
            if "error" in event:
                out.error = event["error"]
                if problem := error_problem(part[6:]):
                    raise ValueError(problem)
                continue
            for choice in event["choices"]:
                i = choice["index"]
                text = (choice["delta"].get("content") or "") if chat else choice["text"]
                out.texts[i] = out.texts.get(i, "") + text
                if choice["finish_reason"] is not None:
                    if i in out.finish:
                        raise ValueError(f"choice {i} finished twice")
                    out.finish[i] = choice["finish_reason"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        out.problem = f"malformed event: {e}"
        return out
    if out.error is None and sorted(out.finish) != list(range(num_choices)):
        out.problem = f"finished choices {sorted(out.finish)} of {num_choices}"
    return out


def check_json(raw: bytes, num_choices: int, chat: bool) -> Answer:
    out = Answer()
    try:
        choices = json.loads(raw)["choices"]
        for c in choices:
            out.texts[c["index"]] = c["message"]["content"] if chat else c["text"]
            out.finish[c["index"]] = c["finish_reason"]
    except (ValueError, KeyError, TypeError) as e:
        out.problem = f"malformed JSON answer: {e}: {raw[:120]!r}"
        return out
    if sorted(out.texts) != list(range(num_choices)) or None in out.finish.values():
        out.problem = f"choices {out.finish} of {num_choices}"
    return out


def check_answer(ctx: Ctx, kind: str, status: int, headers: Any, raw: bytes,
                 body: dict[str, Any], num_choices: int) -> Answer | None:
    """Tally a generation call's answer: 200 (checked) or 429 (under overload)."""
    t = ctx.tally
    t.status(status)
    if status == 429:
        t.rate_limited += 1
        if "Retry-After" not in headers:
            t.fail(kind, "429 without Retry-After")
        if problem := error_problem(raw, None):
            t.fail(kind, f"429: {problem}")
        return None
    if status != 200:
        t.fail(kind, f"status {status}: {raw[:200]!r}")
        return None
    chat = "messages" in body
    if body.get("stream"):
        answer = check_sse(raw, num_choices, chat)
        t.streams["malformed" if answer.problem else "error_event" if answer.error else "ok"] += 1
        if answer.error is not None:
            code = answer.error.get("code")
            if isinstance(code, int) and code >= 500:
                t.server_errors += 1
            t.fail(kind, f"error event {answer.error}")
            return None
    else:
        answer = check_json(raw, num_choices, chat)
    if answer.problem:
        t.fail(kind, answer.problem)
        return None
    reasons = set(answer.finish.values())
    if not reasons <= {"stop", "length"}:
        t.fail(kind, f"finish reasons {sorted(reasons)}")
    stops = body.get("stop") or ()
    if stops and not body.get("use_beam_search") and not body.get("echo"):
        # generation ends at the first stop string, which is cut from the text
        for i, text in answer.texts.items():
            if any(s in text for s in stops):
                t.fail(kind, f"choice {i} holds a stop string of {stops}: {text!r}")
    return answer


# ---- generation cases ----------------------------------------------------------------------

def generation_body(ctx: Ctx, rng: random.Random, kind: str) -> tuple[str, dict[str, Any], int]:
    """(path, body, number of choices) of a valid call of `kind`."""
    chat = kind.startswith("chat")
    body: dict[str, Any] = {"model": ctx.model, "max_tokens": rng.randint(2, ctx.args.max_tokens),
                            "temperature": rng.choice([0.0, 0.7, 1.0]),
                            "seed": rng.randrange(1 << 30)}
    prompt: str | list[str] = rng.choice(PROMPTS)
    n = rng.choice((1, 1, 1, 2, 3))
    if kind == "beam":
        n = rng.choice((2, 3))
        body |= {"use_beam_search": True, "length_penalty": round(rng.uniform(0.5, 1.5), 2),
                 "early_stopping": rng.choice([False, True]), "temperature": 0.0}
    else:
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if rng.random() < 0.25:
            body |= ({"logprobs": True, "top_logprobs": rng.randint(0, 3)} if chat
                     else {"logprobs": rng.randint(0, 3)})
        elif not chat and rng.random() < 0.1:
            body["echo"] = True
        if not chat and rng.random() < 0.15:
            prompt = rng.sample(PROMPTS, rng.randint(2, 3))
    body["n"] = n
    if kind.endswith("stream") or (kind == "beam" and rng.random() < 0.5):
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    num_prompts = len(prompt) if isinstance(prompt, list) else 1
    if chat:
        body["messages"] = [{"role": "system", "content": "Answer briefly."},
                            {"role": "user", "content": prompt}]
        return "/v1/chat/completions", body, n
    body["prompt"] = prompt
    return "/v1/completions", body, num_prompts * n


async def post(ctx: Ctx, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
    async with ctx.http.post(ctx.url + path, json=body, headers=ctx.headers()) as resp:
        return resp.status, resp.headers, await resp.read()


def rate_limited(ctx: Ctx, kind: str, status: int, headers: Any, raw: bytes,
                 attempt: int) -> float | None:
    """A 429 is tallied and checked; returns the seconds to wait before retrying it (as a
    polite client, so the mix keeps running under load), or None: not a 429, or out of tries."""
    if status != 429 or attempt >= RETRIES_429:
        return None
    check_answer(ctx, kind, status, headers, raw, {}, 0)
    try:
        return min(float(headers.get("Retry-After", "1")), 2.0)
    except ValueError:
        return 1.0


async def generation_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    path, body, num_choices = generation_body(ctx, rng, kind)
    for attempt in range(RETRIES_429 + 1):
        status, headers, raw = await post(ctx, path, body)
        if (wait := rate_limited(ctx, kind, status, headers, raw, attempt)) is None:
            break
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))
    check_answer(ctx, kind, status, headers, raw, body, num_choices)


async def disconnect_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    """A stream whose client leaves after a few events (its requests must be aborted)."""
    path, body, num_choices = generation_body(ctx, rng, rng.choice(["completion_stream",
                                                                    "chat_stream"]))
    body |= {"max_tokens": ctx.args.max_tokens * 4, "ignore_eos": True}
    body.pop("stop", None)
    leave_after = rng.randint(1, 3)
    for attempt in range(RETRIES_429 + 1):
        async with ctx.http.post(ctx.url + path, json=body, headers=ctx.headers()) as resp:
            status, headers = resp.status, resp.headers
            if status == 200:
                raw = b""
                while raw.count(b"\n\n") < leave_after:
                    chunk = await resp.content.readany()
                    if not chunk:  # it finished first: an ordinary stream
                        check_answer(ctx, kind, status, headers, raw, body, num_choices)
                        return
                    raw += chunk
                resp.close()  # drop the connection mid-stream
                ctx.tally.status(200)
                ctx.tally.streams["disconnected"] += 1
                return
            raw = await resp.read()
        if (wait := rate_limited(ctx, kind, status, headers, raw, attempt)) is None:
            check_answer(ctx, kind, status, headers, raw, body, num_choices)
            return
        await asyncio.sleep(wait * rng.uniform(0.5, 1.0))


async def cancel_early_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    """A client that gives up before the answer (queued, in prefill or in a plain call)."""
    path, body, num_choices = generation_body(ctx, rng, rng.choice(["completion", "chat"]))
    body |= {"max_tokens": ctx.args.max_tokens * 4, "ignore_eos": True}
    try:
        status, headers, raw = await asyncio.wait_for(post(ctx, path, body),
                                                      rng.uniform(0.01, 0.3))
    except TimeoutError:
        ctx.tally.streams["cancelled"] += 1
        return
    check_answer(ctx, kind, status, headers, raw, body, num_choices)


async def overload_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    """More streams at once than running plus waiting room: some must be answered 429."""
    async def one(i: int) -> None:
        path, body, num_choices = generation_body(ctx, random.Random(rng.random()),
                                                  "completion_stream")
        body |= {"max_tokens": ctx.args.max_tokens * 2, "ignore_eos": True}
        body.pop("stop", None)
        status, headers, raw = await post(ctx, path, body)
        ctx.tally.burst_429 += status == 429
        check_answer(ctx, kind, status, headers, raw, body, num_choices)

    async with ctx.burst_lock:  # one burst at a time keeps the client under --max-connections
        await asyncio.gather(*(one(i) for i in range(ctx.args.burst)))


async def admission_burst(ctx: Ctx, rng: random.Random) -> None:
    """Once the plan is done (nothing else in flight): a burst of n=2 calls at once, each long
    enough that none ends while the burst arrives. The sequences admitted (200) never exceed
    --max-waiting + --max-num-seqs, the rest are 429."""
    kind, n = "admission", 2
    ctx.tally.cases[kind] += 1
    body = {"model": ctx.model, "prompt": rng.choice(PROMPTS), "n": n, "ignore_eos": True,
            "max_tokens": ctx.args.burst_tokens, "seed": rng.randrange(1 << 30)}

    async def one() -> int:
        status, headers, raw = await post(ctx, "/v1/completions", body)
        check_answer(ctx, kind, status, headers, raw, body, n)
        return status

    async with ctx.burst_lock:
        statuses = await asyncio.gather(*(one() for _ in range(ctx.args.burst)))
    admitted = statuses.count(200) * n
    ctx.tally.admitted_seqs.append(admitted)
    bound = ctx.args.max_waiting + ctx.args.max_num_seqs
    if admitted > bound:
        ctx.tally.fail(kind, f"{admitted} sequences admitted by one burst, over --max-waiting "
                       f"{ctx.args.max_waiting} + --max-num-seqs {ctx.args.max_num_seqs}")


# ---- bad requests --------------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: dict[str, Any] | bytes
    status: int
    param: str | None = ANY
    headers: dict[str, str] = field(default_factory=dict)
    method: str = "POST"


def bad_requests(ctx: Ctx) -> list[Bad]:
    c, ch, tok = "/v1/completions", "/v1/chat/completions", "/tokenize"
    gen: dict[str, Any] = {"prompt": "Hi", "max_tokens": 2}
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def role(value: Any) -> dict[str, Any]:
        return {"messages": [{"role": value, "content": "Hi"}], "max_tokens": 2}

    floats = [("repetition_penalty", 1e-38), ("repetition_penalty", 0), ("temperature", -1),
              ("temperature", 1e38), ("top_p", 0), ("top_p", 1.5), ("min_p", 2),
              ("presence_penalty", 1e38), ("frequency_penalty", -3), ("top_k", -2),
              ("max_tokens", 0), ("max_tokens", 10**7), ("n", 0), ("n", 10**6),
              ("logprobs", 1000), ("seed", 2**70), ("min_tokens", -1)]
    cases = [Bad(f"{name} {value}", c, gen | {name: value}, 400, name) for name, value in floats]
    cases += [
        Bad("length_penalty 1000", c, gen | {"use_beam_search": True, "n": 2, "max_tokens": 6,
                                             "length_penalty": 1000, "ignore_eos": True},
            400, "length_penalty"),
        Bad("temperature Infinity", c, b'{"prompt": "Hi", "temperature": Infinity}', 400,
            "temperature"),
        Bad("top_p NaN", c, b'{"prompt": "Hi", "top_p": NaN}', 400, "top_p"),
        Bad("logit_bias 1e38", c, gen | {"logit_bias": {"5": 1e38}}, 400, "logit_bias"),
        Bad("logit_bias id", c, gen | {"logit_bias": {"1000000000": 1}}, 400, "logit_bias"),
        Bad("prompt surrogate", c, gen | {"prompt": "a\ud800"}, 400, "prompt"),
        Bad("chat surrogate", ch, {"messages": [{"role": "user", "content": "\udc00"}]}, 400,
            "messages"),
        Bad("cache_salt surrogate", c, gen | {"cache_salt": "\ud800"}, 400, "cache_salt"),
        Bad("tokenize surrogate", tok, {"prompt": "\ud800"}, 400, "prompt"),
        Bad("role list", ch, role(["user"]), 400, "messages"),
        Bad("role dict", ch, role({"user": 1}), 400, "messages"),
        Bad("role number", ch, role(3), 400, "messages"),
        Bad("content number", ch, {"messages": [{"role": "user", "content": 5}]}, 400,
            "messages"),
        Bad("tokenize role list", tok, {"messages": role(["user"])["messages"]}, 400,
            "messages"),
        Bad("gzip body", c, gzip.compress(json.dumps(gen).encode()), 415, None,
            {"Content-Encoding": "gzip"}),
        Bad("text/plain", c, json.dumps(gen).encode(), 415, None,
            {"Content-Type": "text/plain"}),
        Bad("form", c, b"prompt=Hi", 415, None,
            {"Content-Type": "application/x-www-form-urlencoded"}),
        Bad("tools", ch, chat | {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": [1]}}]}, 400, "tools[0].function.parameters"),
        Bad("tool_choice", ch, chat | {"tools": [{"type": "function", "function": {
            "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            400, "tool_choice"),
        Bad("tools on completions", c, gen | {"tools": [{"type": "function", "function": {
            "name": "f"}}]}, 400, "tools"),
        Bad("suffix", c, gen | {"suffix": "!"}, 400, "suffix"),
        Bad("best_of", c, gen | {"best_of": 3}, 400, "best_of"),
        Bad("prompts x n", c, {"prompt": [PROMPTS[i % 8] for i in range(40)], "n": 8,
                               "max_tokens": 1}, 400, "n"),
        Bad("too many prompts", c, {"prompt": ["Hi"] * 300, "max_tokens": 1}, 400, "prompt"),
        Bad("prompt over the context", c, {"prompt": "hello " * (2 * ctx.max_model_len)}, 400,
            "prompt"),
        Bad("token id", c, {"prompt": [10**9]}, 400, "prompt"),
        Bad("stream_options", c, gen | {"stream_options": {"include_usage": True}}, 400,
            "stream_options"),
        Bad("min_tokens > max_tokens", c, gen | {"min_tokens": 5}, 400, "min_tokens"),
        Bad("echo with logprobs", c, gen | {"echo": True, "logprobs": 1}, 400, "echo"),
        Bad("top_logprobs alone", ch, chat | {"top_logprobs": 2}, 400, "top_logprobs"),
        Bad("response_format", ch, chat | {"response_format": {"type": "json_schema",
                                                                "json_schema": {"schema": {
                                                                    "type": "objekt"}}}},
            400, "response_format.json_schema.schema"),
        Bad("structured_outputs regex", c, gen | {"structured_outputs": {"regex": "[0-9"}}, 400,
            "structured_outputs.regex"),
        Bad("unknown model", c, gen | {"model": "no-such-model"}, 404, "model"),
        Bad("malformed JSON", c, b'{"prompt": ', 400, None),
        Bad("JSON array", c, b"[1, 2]", 400, None),
        Bad("deep nesting", c, b"[" * 100_000 + b"]" * 100_000, 400, None),
        Bad("bad UTF-8", c, b'{"prompt": "\xff\xfe"}', 400, None),
        Bad("unknown route", "/v1/nothing", gen, 404, None),
        Bad("GET a POST route", c, b"", 405, None, method="GET"),
    ]
    if ctx.api_key:
        cases += [Bad("no API key", c, gen, 401, None, {"Authorization": ""}),
                  Bad("wrong API key", c, gen, 401, None, {"Authorization": "Bearer sk-wrong"})]
    if ctx.args.max_body_size is not None:
        size = ctx.args.max_body_size + 1
        cases.append(Bad("body over the limit", c, b'{"prompt": "' + b"a" * size + b'"}', 413,
                         None, {"Connection": "close"}))
    return cases


async def bad_case(ctx: Ctx, bad: Bad) -> None:
    headers = {k: v for k, v in ctx.headers(bad.headers).items() if v}
    data = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    for attempt in range(RETRIES_429 + 1):
        async with ctx.http.request(bad.method, ctx.url + bad.path, data=data,
                                    headers=headers) as resp:
            status, raw = resp.status, await resp.read()
        if status != 429 or bad.status == 429 or attempt == RETRIES_429:
            break
        # a call that can never run told to retry: tallied, then retried as a client would
        ctx.tally.bad_429.add(bad.name)
        ctx.tally.status(429)
        await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
    ctx.tally.status(status)
    if status != bad.status:
        ctx.tally.fail(f"bad {bad.name}", f"status {status}, expected {bad.status}: "
                       f"{raw[:160]!r}")
    elif problem := error_problem(raw, bad.param):
        ctx.tally.fail(f"bad {bad.name}", problem)


# ---- raw sockets ---------------------------------------------------------------------------

def parse_response(buf: bytes) -> tuple[int | None, bytes]:
    head, _, body = buf.partition(b"\r\n\r\n")
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", head)
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    if length:
        body = body[:int(length.group(1))]
    return (int(match.group(1)) if match else None), body


async def read_until_closed(reader: asyncio.StreamReader, limit: float) -> tuple[bytes, bool]:
    buf = b""
    try:
        async with asyncio.timeout(limit):
            while chunk := await reader.read(1 << 16):
                buf += chunk
    except TimeoutError:
        return buf, False
    except ConnectionError:
        pass
    return buf, True


def raw_requests(key: str) -> list[tuple[str, bytes]]:
    post = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
    return [
        ("bad request line", b"GARBAGE\r\n\r\n"),
        ("NUL in Authorization", post + b"Authorization: Bearer " + key.encode()
         + b"\x00\r\nContent-Length: 2\r\n\r\n{}"),
        ("100 KB header", b"GET /health HTTP/1.1\r\nHost: soak\r\nX-Big: " + b"a" * 100_000
         + b"\r\n\r\n"),
        ("URL over 8190 bytes", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: soak\r\n\r\n"),
        ("Content-Length with Transfer-Encoding",
         post + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}"),
        ("bad chunk size", post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"),
        ("bad Content-Length", post + b"Content-Length: abc\r\n\r\n"),
        ("bare LF", b"GET /health HTTP/1.1\nHost: soak\n\n"),
        ("HTTP/2.0 request line", b"GET /health HTTP/2.0\r\nHost: soak\r\n\r\n"),
    ]


async def raw_case(ctx: Ctx, name: str, data: bytes) -> None:
    """A request aiohttp's parser refuses: a 400 (or 431) JSON error, then the socket closes;
    another HTTP version than 1.x: a 505, in HTTP/1.1."""
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
    try:
        writer.write(data)
        await writer.drain()
        buf, closed = await read_until_closed(reader, 10.0)
    finally:
        writer.close()
    status, body = parse_response(buf)
    ctx.tally.status(status)
    expected = (505,) if name.startswith("HTTP/2") else (400, 431)
    if status not in expected or (status == 505 and not buf.startswith(b"HTTP/1.1 ")):
        ctx.tally.fail(f"raw {name}", f"status {status}: {buf[:160]!r}")
    elif problem := error_problem(body, None):
        ctx.tally.fail(f"raw {name}", problem)
    elif not closed:
        ctx.tally.fail(f"raw {name}", "the connection stayed open")


async def slow_case(ctx: Ctx, name: str, head: bytes, trickle: bool, timeout: float,
                    close_within: float) -> None:
    """A client that stalls in its header (trickling a byte at a time) or its body: a 408 JSON
    error within the timeout, and the connection closed within `close_within` seconds."""
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
    start = time.monotonic()
    buf, closed = b"", False
    try:
        writer.write(head)
        await writer.drain()
        while trickle and not buf and time.monotonic() - start < timeout + 5:
            try:  # one header byte at a time, never the end of the header block
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                break
            try:
                buf = await asyncio.wait_for(reader.read(1 << 16), timeout / 4)
            except TimeoutError:
                continue
            closed = not buf
        rest, closed = await read_until_closed(reader, close_within - (time.monotonic() - start))
        buf += rest
    finally:
        writer.close()
    elapsed = time.monotonic() - start
    ctx.tally.close_s[name] = max(ctx.tally.close_s.get(name, 0.0), round(elapsed, 2))
    status, body = parse_response(buf)
    ctx.tally.status(status)
    if status != 408:
        ctx.tally.fail(name, f"status {status} after {elapsed:.1f} s: {buf[:160]!r}")
    elif problem := error_problem(body, None):
        ctx.tally.fail(name, problem)
    elif not closed:
        ctx.tally.fail(name, f"the connection was still open after {elapsed:.1f} s")


async def slowloris_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    timeout = ctx.args.header_timeout
    await slow_case(ctx, "slowloris", b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nX-Slow: ",
                    True, timeout, timeout + 5)


async def short_body_case(ctx: Ctx, rng: random.Random, kind: str) -> None:
    timeout = ctx.args.body_timeout
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {ctx.api_key or ''}\r\nContent-Length: 100\r\n\r\n"
            '{"prompt": ').encode()
    await slow_case(ctx, "short body", head, False, timeout, timeout + LINGER_S + 5)


# ---- phases --------------------------------------------------------------------------------

Case = Callable[[Ctx, random.Random, str], Awaitable[None]]
CASES: dict[str, Case] = {
    "completion": generation_case, "completion_stream": generation_case, "chat": generation_case,
    "chat_stream": generation_case, "beam": generation_case, "disconnect": disconnect_case,
    "cancel_early": cancel_early_case, "overload": overload_case, "slowloris": slowloris_case,
    "short_body": short_body_case,
}


def make_plan(args: argparse.Namespace, num_bad: int, num_raw: int) -> list[tuple[str, int]]:
    """Every bad and raw case once, the slow clients and the bursts, then a random mix."""
    rng = random.Random(args.seed)
    plan = ([("bad", i) for i in range(num_bad)] + [("raw", i) for i in range(num_raw)]
            + [("slowloris", 0), ("short_body", 0)] + [("overload", 0)] * args.bursts)
    kinds, weights = zip(*MIX.items(), strict=True)
    while len(plan) < args.requests:
        kind = rng.choices(kinds, weights)[0]
        plan.append((kind, rng.randrange(num_bad if kind == "bad" else num_raw)))
    rng.shuffle(plan)
    return plan


def case_limit(args: argparse.Namespace, kind: str) -> float:
    """Seconds a case may take before it counts as hung."""
    return {"slowloris": args.header_timeout + 15, "short_body": args.body_timeout + LINGER_S + 15,
            "overload": 2 * args.request_timeout}.get(kind, args.request_timeout)


async def run_case(ctx: Ctx, kind: str, arg: int, rng: random.Random,
                   bads: list[Bad], raws: list[tuple[str, bytes]]) -> None:
    t = ctx.tally
    t.cases[kind] += 1
    try:
        async with asyncio.timeout(case_limit(ctx.args, kind)):
            if kind == "bad":
                await bad_case(ctx, bads[arg])
            elif kind == "raw":
                await raw_case(ctx, *raws[arg])
            else:
                await CASES[kind](ctx, rng, kind)
    except TimeoutError:
        t.hung[kind] += 1
        t.fail(kind, f"no complete answer within {case_limit(ctx.args, kind):g} s")
    except (aiohttp.ClientError, ConnectionError) as e:  # the server dropped a connection
        t.status(None)
        t.fail(kind, f"{type(e).__name__}: {e}")


async def run_plan(ctx: Ctx, plan: list[tuple[str, int]]) -> int:
    """The plan on --concurrency workers until it ends or --duration passes; cases run."""
    bads, raws = bad_requests(ctx), raw_requests(ctx.api_key or "sk-none")
    items = iter(enumerate(plan))
    deadline = time.monotonic() + ctx.args.duration
    ran = 0

    async def worker() -> None:
        nonlocal ran
        for index, (kind, arg) in items:
            if time.monotonic() > deadline:
                return
            ran += 1
            await run_case(ctx, kind, arg, random.Random(ctx.args.seed * 1_000_003 + index),
                           bads, raws)

    stop = asyncio.Event()
    probe = asyncio.create_task(health_probe(ctx, stop))
    await asyncio.gather(*(worker() for _ in range(ctx.args.concurrency)))
    stop.set()
    await probe
    return ran


async def health_probe(ctx: Ctx, stop: asyncio.Event) -> None:
    """GET /health every 100 ms while the plan runs and record how long the answers took: the
    slowest is the longest the server's event loop was unable to answer anyone (request-sized
    CPU work on the loop would show here; this client's own loop adds to it)."""
    gaps = ctx.tally.health_s
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with ctx.http.get(ctx.url + "/health",
                                    timeout=aiohttp.ClientTimeout(total=60)) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass
        gaps.append(time.monotonic() - t0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)


async def connection_cap(ctx: Ctx) -> None:
    """--max-connections holds whether connections arrive one at a time or all at once: past
    the cap they are answered 503 in JSON and closed; once they close, the server takes
    connections again. Run while the soak holds no other connection."""
    for at_once in (True, False):
        how = "all at once" if at_once else "one at a time"
        writers = []
        try:
            readers = []
            count = ctx.args.max_connections + 1
            if at_once:  # every connect in flight together: the server accepts them in a batch
                pairs = await asyncio.gather(*(asyncio.open_connection(ctx.host, ctx.port)
                                               for _ in range(count)))
                readers, writers = [r for r, _ in pairs], [w for _, w in pairs]
            for _ in range(0 if at_once else count):
                reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
                readers.append(reader)
                writers.append(writer)
                # the server has taken it before the next; all open well within the header
                # timeout, which closes a silent connection that long after it opened
                await asyncio.sleep(min(0.02, ctx.args.header_timeout / 2 / count))
            answers = await asyncio.gather(*(read_until_closed(r, 2.0) for r in readers))
        finally:
            for writer in writers:
                writer.close()
        refused = 0
        for buf, _ in answers:
            if not buf:
                continue
            status, body = parse_response(buf)
            refused += status == 503
            ctx.tally.statuses["503 (connection cap)" if status == 503 else str(status)] += 1
            if status != 503 or error_problem(body, None):
                ctx.tally.fail(f"connection cap, {how}", f"answered {buf[:160]!r}")
        ctx.tally.cap_503[how] = refused
        if refused == 0:
            ctx.tally.fail(f"connection cap, {how}", f"no 503 with {len(writers)} connections "
                           f"open (--max-connections {ctx.args.max_connections})")
        if not await health_ok(ctx):
            ctx.tally.fail(f"connection cap, {how}", "/health not 200 once they closed")


async def idle_sockets(ctx: Ctx) -> None:
    """--max-connections sockets that never send a byte: while they are open a new client gets
    the cap's 503; the server closes each without an answer within --header-timeout of its
    opening (plus 2 s of slack); then it takes connections again."""
    count, limit = ctx.args.max_connections, ctx.args.header_timeout
    start = time.monotonic()
    pairs = await asyncio.gather(*(asyncio.open_connection(ctx.host, ctx.port)
                                   for _ in range(count)))
    try:
        await asyncio.sleep(0.1)
        full = await health_status(ctx)
        ends = await asyncio.gather(*(read_until_closed(r, limit + 10) for r, _ in pairs))
        closed_s = time.monotonic() - start
    finally:
        for _, writer in pairs:
            writer.close()
    answered = sum(bool(buf) for buf, _ in ends)
    still_open = sum(not closed for _, closed in ends)
    ctx.tally.idle_sockets = {"count": count, "status_while_full": full,
                              "closed_after_s": round(closed_s, 2), "answered": answered,
                              "still_open": still_open}
    if full != 503:
        ctx.tally.fail("idle sockets", f"a client got {full} while {count} silent sockets "
                       "held every slot, not the cap's 503")
    if answered or still_open or closed_s > limit + 2:
        ctx.tally.fail("idle sockets", f"{still_open} of {count} still open, {answered} "
                       f"answered, the last closed after {closed_s:.1f} s (--header-timeout "
                       f"{limit:g})")
    if not await health_ok(ctx):
        ctx.tally.fail("idle sockets", "/health not 200 once they closed")


async def health_status(ctx: Ctx) -> int | None:
    """The status of one GET /health on a new connection."""
    reader, writer = await asyncio.open_connection(ctx.host, ctx.port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
        buf, _ = await read_until_closed(reader, 2.0)
    finally:
        writer.close()
    return parse_response(buf)[0]


async def health_ok(ctx: Ctx, wait_s: float = 5.0) -> bool:
    """GET /health on a new connection until 200 (the server notices closed connections)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if await health_status(ctx) == 200:
            return True
        await asyncio.sleep(0.1)
    return False


METRIC = re.compile(r'^(kvcore:\w+)\{([^}]*)\} (\S+)$', re.M)


async def idle_metrics(ctx: Ctx, wait_s: float = 60.0) -> dict[str, Any]:
    """/metrics once nothing runs or waits (or after `wait_s`): the pool must be all free."""
    deadline = time.monotonic() + wait_s
    while True:
        async with ctx.http.get(ctx.url + "/metrics") as resp:
            text = await resp.text()
        values = {name: (labels, float(v)) for name, labels, v in METRIC.findall(text)}
        running = values["kvcore:num_requests_running"][1]
        waiting = values["kvcore:num_requests_waiting"][1]
        if (running == 0 and waiting == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    match = re.search(r'num_blocks="(\d+)"', values["kvcore:cache_config_info"][0])
    num_blocks = int(match.group(1)) if match else -1
    free = int(values["kvcore:num_free_blocks"][1])
    return {"num_requests_running": int(running), "num_requests_waiting": int(waiting),
            "kv_cache_usage_perc": values["kvcore:kv_cache_usage_perc"][1],
            "num_free_blocks": free, "num_blocks": num_blocks, "leaked_blocks": num_blocks - free}


async def drain_phase(ctx: Ctx, server: Server) -> int | None:
    """SIGTERM while streams run: each ends well-formed (finish_reason "abort" once the drain
    timeout passes, then [DONE]); returns the server's exit status."""
    body = {"model": ctx.model, "prompt": PROMPTS[0], "ignore_eos": True, "stream": True,
            "max_tokens": min(ctx.max_model_len - 64, 1000)}
    started = asyncio.Event()
    count = ctx.args.drain_streams
    arrived = 0

    async def stream() -> None:
        nonlocal arrived
        async with ctx.http.post(ctx.url + "/v1/completions", json=body,
                                 headers=ctx.headers()) as resp:
            try:
                raw = await resp.content.readany()  # the headers come with the first token
            finally:
                arrived += 1
                if arrived == count:
                    started.set()
            raw += await resp.read()
        ctx.tally.status(resp.status)
        answer = check_sse(raw, 1, chat=False) if resp.status == 200 else None
        if answer is None or answer.problem or answer.error:
            ctx.tally.streams["malformed"] += 1
            ctx.tally.fail("drain", f"status {resp.status}: "
                           f"{answer.problem or answer.error if answer else raw[:160]!r}")
        else:
            ctx.tally.streams["ok"] += 1
            ctx.tally.drain_finish.update(answer.finish.values())

    tasks = [asyncio.create_task(stream()) for _ in range(count)]
    try:
        async with asyncio.timeout(ctx.args.request_timeout):
            await started.wait()
            server.proc.send_signal(signal.SIGTERM)
            for done in asyncio.as_completed(tasks):
                try:
                    await done
                except (aiohttp.ClientError, ConnectionError) as e:
                    ctx.tally.fail("drain", f"{type(e).__name__}: {e}")
    except TimeoutError:
        ctx.tally.hung["drain"] += sum(not task.done() for task in tasks)
        ctx.tally.fail("drain", "streams still open after SIGTERM")
    for task in tasks:
        task.cancel()
    return await asyncio.to_thread(server.wait, ctx.args.drain_timeout + 30)


# ---- constraints: crash, error, stall and memory shapes (tools/soak_constraints.py) --------

async def constraint_phase(ctx: Ctx, pid: int | None) -> dict[str, Any]:
    """Each crash shape (at --constraint-scale times the lengths that crashed) and each error
    shape a 400 naming its field, a plain request answered after each; a plain stream's gaps
    while large grammars compile; the server's RSS across --unique-schemas large schemas."""
    args, tally = ctx.args, ctx.tally
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    statuses: dict[str, int] = {}
    for name, fields, param in (shapes.crash_cases(args.constraint_scale)
                                + shapes.error_cases()):
        tally.cases["constraint"] += 1
        status, _, raw = await post(ctx, "/v1/chat/completions", {**chat, **fields})
        tally.status(status)
        statuses[name] = status
        problem = f"answered {status}" if status != 400 else error_problem(raw, param)
        if problem:
            tally.fail(f"constraint {name}", problem)
        alive, _, raw = await post(ctx, "/v1/chat/completions", chat)
        tally.status(alive)
        if alive != 200:
            tally.fail(f"constraint {name}", f"the plain request after it answered {alive}")

    async def answer(body: dict[str, Any]) -> tuple[int, bytes]:
        status, _, raw = await post(ctx, "/v1/completions", {"prompt": "x", **body})
        tally.status(status)
        return status, raw

    async def stream(body: dict[str, Any], times: list[float]) -> None:
        async with ctx.http.post(ctx.url + "/v1/completions", json={**body, "stream": True},
                                 headers=ctx.headers()) as resp:
            tally.status(resp.status)
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    times.append(time.monotonic())

    run = secrets.token_hex(4)  # unique constraints: never a cache hit from an earlier soak
    plain = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0,
             "max_tokens": max(min(256, ctx.max_model_len - 16), 1)}
    stall = await shapes.checked_stall_probe(answer, stream, plain, args.constraint_grammars,
                                             run)
    if any(status != 200 for status in stall["grammar_statuses"]):
        tally.fail("constraint stall", f"large constraints answered {stall['grammar_errors']}")
    memory = (await shapes.memory_loop(answer, lambda: shapes.rss_bytes(pid),
                                       args.unique_schemas, run)
              if pid is not None and args.unique_schemas else {})
    if memory and memory["statuses"] != {"200": args.unique_schemas}:
        tally.fail("constraint memory", f"unique schemas answered {memory['statuses']}")
    return {"statuses": statuses, "stall": stall, "memory": memory}


def constraint_checks(args: argparse.Namespace, report: dict[str, Any]
                      ) -> dict[str, bool | None]:
    if not report:
        return {"constraint_stall_bounded": None, "constraint_rss_flat": None}
    memory = report["memory"]
    return {"constraint_stall_bounded": report["stall"]["verdict"]["ok"],
            "constraint_rss_flat": (memory["growth_after_warm_mb"] <= args.constraint_rss_mb
                                    if memory else None)}


# ---- the server and its log ----------------------------------------------------------------

class Server:
    """`kvcore serve` as a child process; its stderr (JSON lines) is kept line by line."""

    def __init__(self, cmd: list[str], log: IO[str] | None) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.url: str | None = None
        self._serving = threading.Event()
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            if self._log is not None:
                self._log.write(line + "\n")
            if self.url is None and '"serving"' in line:
                try:
                    self.url = json.loads(line).get("url")
                except (ValueError, AttributeError):
                    continue
                self._serving.set()
        self._serving.set()

    def wait_serving(self, timeout: float) -> str:
        self._serving.wait(timeout)
        if self.url is None:
            self.stop()
            tail = "\n".join(self.lines[-20:])
            raise RuntimeError(f"kvcore serve did not start:\n{tail}")
        return self.url

    def wait(self, timeout: float) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._reader.join(10)
        return code

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(10)
        return self.proc.returncode


def check_log(lines: list[str], api_key: str | None) -> dict[str, Any]:
    """Every line one JSON object, no traceback, never the API key; request outcomes counted."""
    non_json = tracebacks = key_lines = 0
    outcomes: Counter[str] = Counter()
    examples: list[str] = []
    for line in lines:
        if api_key and api_key in line:
            key_lines += 1
            examples.append(f"API key in: {line[:200]}")
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            non_json += 1
            tracebacks += "Traceback (most recent call last)" in line
            examples.append(f"not JSON: {line[:200]}")
            continue
        if "exception" in record or "Traceback (most recent call last)" in line:
            tracebacks += 1
            examples.append(f"traceback: {line[:300]}")
        if record.get("event") == "request":
            outcomes[str(record.get("outcome"))] += 1
    server_errors = sum(v for k, v in outcomes.items() if k.startswith("error 5"))
    return {"lines": len(lines), "key_checked": bool(api_key), "non_json_lines": non_json,
            "tracebacks": tracebacks, "api_key_lines": key_lines,
            "request_outcomes": dict(outcomes),
            "error_5xx_outcomes": server_errors, "examples": examples[:10]}


# ---- the run -------------------------------------------------------------------------------

async def wait_ready(http: aiohttp.ClientSession, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url}/health was not 200 within {timeout:g} s")


def serve_command(args: argparse.Namespace, api_key: str) -> list[str]:
    cmd = [*SERVE, *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", "0",
           "--api-key", api_key, "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting", str(args.max_waiting), "--max-connections", str(args.max_connections),
           "--header-timeout", f"{args.header_timeout:g}",
           "--body-timeout", f"{args.body_timeout:g}",
           "--drain-timeout", f"{args.drain_timeout:g}", "--seed", str(args.seed)]
    if args.max_body_size is not None:
        cmd += ["--max-body-size", str(args.max_body_size)]
    return cmd + shlex.split(args.server_args)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    server = None
    log_file = open(args.log, "w") if args.log and not args.url else None  # noqa: SIM115
    if args.url:
        url, api_key = args.url.rstrip("/"), args.api_key
    else:
        api_key = args.api_key or f"sk-soak-{secrets.token_hex(12)}"
        server = Server(serve_command(args, api_key), log_file)
        url = await asyncio.to_thread(server.wait_serving, args.startup_timeout)
    host, port = re.match(r"https?://([^:/]+):(\d+)", url).groups()  # type: ignore[union-attr]
    ran, exit_code, metrics, model_id = 0, None, {}, args.model or "default"
    tally = Tally()
    try:
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=timeout) as http:
            await wait_ready(http, url, args.startup_timeout)
            auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            async with http.get(url + "/v1/models", headers=auth) as resp:
                model = (await resp.json())["data"][0]
            model_id = model["id"]
            ctx = Ctx(args, http, url, host, int(port), api_key, model_id,
                      model["max_model_len"], tally)
            plan = make_plan(args, len(bad_requests(ctx)), len(raw_requests("k")))
            ran = await run_plan(ctx, plan)
            await idle_metrics(ctx)  # the plan's last calls have ended
            try:
                async with asyncio.timeout(2 * args.request_timeout):
                    await admission_burst(ctx, random.Random(args.seed))
            except TimeoutError:
                tally.hung["admission"] += 1
                tally.fail("admission", "the burst was not answered in full")
            if args.constraints:
                tally.constraints = await constraint_phase(
                    ctx, server.proc.pid if server is not None else None)
        # the session's kept-alive connections are closed now: the cap check counts its own
        if server is not None:
            await asyncio.sleep(0.5)
            await connection_cap(ctx)
            await idle_sockets(ctx)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            ctx.http = http
            metrics = await idle_metrics(ctx)
            if server is not None:
                exit_code = await drain_phase(ctx, server)
    finally:
        if server is not None:
            code = server.stop()
            exit_code = exit_code if exit_code is not None else code
        if log_file is not None:
            log_file.close()
    if server is not None:
        log = check_log(server.lines, api_key)
    elif args.log:
        with open(args.log, errors="replace") as f:
            log = check_log(f.read().splitlines(), api_key)
    else:
        log = {}
    return summarize(args, model_id, tally, plan, ran, metrics, log, exit_code,
                     server is not None, time.monotonic() - start)


def summarize(args: argparse.Namespace, model: str, t: Tally, plan: list[tuple[str, int]], ran: int,
              metrics: dict[str, Any], log: dict[str, Any], exit_code: int | None, owned: bool,
              wall_s: float) -> dict[str, Any]:
    hung = sum(t.hung.values())
    checks: dict[str, bool | None] = {
        "no_5xx": t.server_errors == 0 and log.get("error_5xx_outcomes", 0) == 0,
        "no_hung": hung == 0,
        "streams_well_formed": t.streams["malformed"] == 0,
        "answers_as_expected": t.num_failures == 0,
        "overload_hit_429": t.burst_429 > 0 if t.cases["overload"] else None,
        "admission_bounded": (max(t.admitted_seqs) <= args.max_waiting + args.max_num_seqs
                              if t.admitted_seqs else None),
        "idle_sockets_closed": (t.idle_sockets.get("still_open") == 0
                                and t.idle_sockets.get("answered") == 0
                                and t.idle_sockets.get("closed_after_s", 1e9)
                                <= args.header_timeout + 2 if owned else None),
        "idle_after": bool(metrics) and metrics["num_requests_running"] == 0
        and metrics["num_requests_waiting"] == 0 and metrics["kv_cache_usage_perc"] == 0,
        "no_leaked_blocks": bool(metrics) and metrics["leaked_blocks"] == 0,
        "log_json_only": log["non_json_lines"] == 0 if log else None,
        "no_tracebacks": log["tracebacks"] == 0 if log else None,
        "api_key_not_logged": log["api_key_lines"] == 0 if log.get("key_checked") else None,
        "drain_exit_0": exit_code == 0 if owned else None,
        **constraint_checks(args, t.constraints),
    }
    return {
        "model": model, "seed": args.seed, "concurrency": args.concurrency,
        "cases_planned": len(plan), "cases_run": ran, "cases": dict(t.cases),
        "requests": sum(t.statuses.values()), "status": dict(sorted(t.statuses.items())),
        "server_errors_5xx": t.server_errors + log.get("error_5xx_outcomes", 0),
        "streams": {"ok": t.streams["ok"], "malformed": t.streams["malformed"], "hung": hung,
                    "error_event": t.streams["error_event"],
                    "disconnected": t.streams["disconnected"],
                    "cancelled_early": t.streams["cancelled"]},
        "hung_by_kind": dict(t.hung), "rate_limited_429": t.rate_limited,
        "burst_429": t.burst_429, "bad_requests_429_first": sorted(t.bad_429),
        "connection_cap_503": t.cap_503,
        "admission_bursts_admitted_seqs": t.admitted_seqs, "idle_sockets": t.idle_sockets,
        "slow_client_close_s": t.close_s, "drain_finish_reasons": dict(t.drain_finish),
        "health_probe": _gaps(t.health_s), "constraints": t.constraints,
        "server_exit_code": exit_code, "metrics_after": metrics,
        "leaked_blocks": metrics.get("leaked_blocks"),
        "log": {k: v for k, v in log.items() if k != "examples"},
        "log_examples": log.get("examples", []),
        "num_failures": t.num_failures, "failures": t.failures, "wall_s": round(wall_s, 1),
        "checks": checks, "ok": all(v is not False for v in checks.values()),
    }


def _gaps(times: list[float]) -> dict[str, float | int]:
    """/health answer times: how many, median, p99 and the slowest, in seconds."""
    if not times:
        return {"count": 0}
    ordered = sorted(times)
    return {"count": len(ordered), "median_s": round(ordered[len(ordered) // 2], 4),
            "p99_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
            "max_s": round(ordered[-1], 4)}


def print_summary(s: dict[str, Any]) -> None:
    print(f"soak: {s['cases_run']} cases, {s['requests']} requests in {s['wall_s']} s "
          f"(model {s['model']}, concurrency {s['concurrency']}, seed {s['seed']})")
    print(f"  cases: {s['cases']}")
    print(f"  status: {s['status']}")
    print(f"  request log outcomes: {s['log'].get('request_outcomes')}")
    print(f"  streams: {s['streams']}; 429: {s['rate_limited_429']} "
          f"(bursts {s['burst_429']}); connection cap 503: {s['connection_cap_503']}")
    if s["bad_requests_429_first"]:
        print(f"  bad requests answered 429 before their 4xx: {s['bad_requests_429_first']}")
    print(f"  admission bursts, sequences admitted: {s['admission_bursts_admitted_seqs']}; "
          f"idle sockets: {s['idle_sockets']}")
    print(f"  slow clients closed after (s): {s['slow_client_close_s']}; drain: "
          f"{s['drain_finish_reasons']}, exit {s['server_exit_code']}")
    print(f"  /health during the run (s): {s['health_probe']}")
    if s["constraints"]:
        c = s["constraints"]
        print(f"  constraint shapes: {c['statuses']}")
        print(f"  constraint stall (token gaps, s): {c['stall']}")
        print(f"  constraint memory: {c['memory']}")
    print(f"  after: {s['metrics_after']}")
    print(f"  log: {s['log']}")
    for line in s["failures"] + s["log_examples"]:
        print(f"  FAIL {line}")
    verdict = ", ".join(f"{k}={'skip' if v is None else 'ok' if v else 'FAIL'}"
                        for k, v in s["checks"].items())
    print(f"  checks: {verdict}")
    print("soak: " + ("PASS" if s["ok"] else "FAIL"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `kvcore serve`)")
    p.add_argument("--api-key", help="the key to send (default: a random one for the server "
                                     "it starts)")
    p.add_argument("--model", help="model directory for the server it starts (default: the "
                                   "default model)")
    p.add_argument("--server-args", default="", help="more `kvcore serve` options, one string")
    p.add_argument("--log", help="write the server's log here (with --url: read it from here)")
    p.add_argument("--requests", type=int, default=300, help="cases to run (default 300; at "
                   "least every bad and raw case once)")
    p.add_argument("--concurrency", type=int, default=8, help="cases at once (default 8)")
    p.add_argument("--duration", type=float, default=180.0,
                   help="start no case after this many seconds (default 180)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="a call not answered in full within this is hung (default 120)")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of a call at most")
    p.add_argument("--bursts", type=int, default=3, help="overload bursts (default 3)")
    p.add_argument("--burst", type=int, help="streams per burst (default: max-num-seqs + "
                                             "max-waiting + 8)")
    p.add_argument("--burst-tokens", type=int, default=64,
                   help="max_tokens of the admission burst's calls: none may end while the burst "
                        "arrives (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-constraints", dest="constraints", action="store_false",
                   help="skip the constraint phase (crash, error, stall and memory shapes)")
    p.add_argument("--constraint-scale", type=float, default=1.0,
                   help="crash shapes at this many times the lengths that crashed (default 1: "
                        "~100 KB bodies; 10 needs --max-body-size of 2 MiB)")
    p.add_argument("--constraint-grammars", type=int, default=2,
                   help="unique 220 KB grammars sent during the stall probe (default 2)")
    p.add_argument("--unique-schemas", type=int, default=40,
                   help="unique large-enum schemas of the memory loop (default 40; 0: none)")
    p.add_argument("--constraint-rss-mb", type=float, default=128.0,
                   help="the server's RSS may grow this much after the loop's first quarter "
                        "(default 128: the cache's 64 MiB tenant share and as much slack)")
    p.add_argument("--json", help="write the summary here as one JSON object")
    server = p.add_argument_group("limits of the server it starts (with --url: of that server)")
    server.add_argument("--max-num-seqs", type=int, default=8)
    server.add_argument("--max-waiting", type=int, default=8)
    server.add_argument("--max-connections", type=int, default=64,
                        help="at least concurrency + burst + 8: the cap is tested on its own")
    server.add_argument("--header-timeout", type=float, default=2.0)
    server.add_argument("--body-timeout", type=float, default=2.0)
    server.add_argument("--drain-timeout", type=float, default=1.0)
    server.add_argument("--max-body-size", type=int, help="bytes (default: 1 MiB for the server "
                        "it starts; with --url, no 413 case unless given)")
    server.add_argument("--drain-streams", type=int, default=3)
    server.add_argument("--startup-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.max_body_size is None and args.url is None:
        args.max_body_size = 1 << 20
    if args.burst is None:
        args.burst = args.max_num_seqs + args.max_waiting + 8
    if args.max_connections < args.concurrency + args.burst + 8:
        p.error(f"--max-connections must be >= concurrency + burst + 8 = "
                f"{args.concurrency + args.burst + 8}: only the cap check may meet the cap")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    summary = asyncio.run(soak(args))
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

"""The soak's constraint phase (tools/soak.py): request shapes that crashed, stalled or bloated
servers built on llguidance, sent to a live kvcore server.

- crash shapes: a JSON schema that is a chain of $refs, a $ref chain of arrays, a Lark grammar
  that is a chain of rules (at `scale` times the lengths that crashed: 3,000 / 2,000 / 3,000),
  each must be a 400 naming its field, and the server must go on answering;
- clear errors: unsatisfiable constraints (a required recursive $ref, a $ref cycle, a rule with
  no finite derivation), `strict` that is not a boolean, tools whose grammar is too large, a
  lone surrogate in a call's arguments: 400s naming the field;
- stall shapes: the longest gap between a plain stream's tokens alone, then while large grammars
  (unique 20,000-way alternations), a 100-property schema and backtracking-prone regexes arrive;
- memory: the server's resident set size across a loop of unique large schemas (enums of
  thousands of values), which the byte-bounded cache must keep flat.

Shapes are also used by the tests (tests/test_constraint_safety_service.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

CRASH_LENGTHS = {"schema_chain": 3000, "array_chain": 2000, "grammar_chain": 3000}
STALL_REGEXES = ("a**", "(x+x+)+y", r"(\w+\s?)*$")
UNIQUE_ENUM_VALUES = 12_000  # ~220 KB of schema: llguidance holds ~5 MB compiled


def schema_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def array_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}
                            for i in range(n - 1)}
    defs[f"d{n - 1}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def grammar_chain(n: int) -> str:
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a" | "b"' for i in range(n - 1)),
                      f'r{n - 1}: "c"'])


def alternation(n: int, tag: str = "") -> str:
    """A Lark grammar of n literal alternatives (~11 bytes each; 20,000: 220 KB, a compile of
    0.4-1 s), `tag` the first (grammars of different tags are different)."""
    return f'start: "{tag}" | ' + " | ".join(f'"w{i:06d}x"' for i in range(n))


def unique_enum(i: int, num_values: int = UNIQUE_ENUM_VALUES) -> dict[str, Any]:
    return {"type": "object", "properties": {"pick": {"enum": [
        f"v{i}-{k:06d}" for k in range(num_values)]}}, "required": ["pick"]}


def schema_format(schema: dict[str, Any], strict: Any = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                   "strict": strict}}


SCHEMA_PARAM = "response_format.json_schema.schema"


def crash_cases(scale: float) -> list[tuple[str, dict[str, Any], str]]:
    """(name, body fields, the param its 400 must name) of each crash shape at `scale` times
    the lengths that crashed."""
    n = {k: max(int(v * scale), 2) for k, v in CRASH_LENGTHS.items()}
    return [
        ("schema_chain", {"response_format": schema_format(schema_chain(n["schema_chain"]))},
         SCHEMA_PARAM),
        ("array_chain", {"response_format": schema_format(array_chain(n["array_chain"]))},
         SCHEMA_PARAM),
        ("grammar_chain", {"structured_outputs": {"grammar": grammar_chain(n["grammar_chain"])}},
         "structured_outputs.grammar"),
    ]


def error_cases() -> list[tuple[str, dict[str, Any], str]]:
    """The unsatisfiable, mistyped, oversized and invalid-Unicode constraints (S3, S4, S6)."""
    recursive = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                 "required": ["x"]}}, "$ref": "#/$defs/a"}
    cycle = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
             "$ref": "#/$defs/a"}
    many = [{"type": "function", "function": {"name": f"tool_{t}", "parameters": {
        "type": "object", "properties": {f"p{p}": {"type": "string"} for p in range(100)}}}}
        for t in range(128)]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"city": "\\ud800"}'}}
    return [
        ("recursive_required_ref", {"response_format": schema_format(recursive)}, SCHEMA_PARAM),
        ("ref_cycle", {"response_format": schema_format(cycle)}, SCHEMA_PARAM),
        ("rule_without_end", {"structured_outputs": {"grammar": 'start: a\na: a "x"'}},
         "structured_outputs.grammar"),
        ("strict_not_boolean", {"response_format": schema_format({"type": "object"}, "yes")},
         "response_format.json_schema.strict"),
        ("tools_too_large", {"tools": many, "tool_choice": "required"}, "tools"),
        ("surrogate_in_arguments", {"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{}"}]}, "messages"),
    ]


def stall_bodies(num_grammars: int, run: str) -> list[dict[str, Any]]:
    """The large constraints sent while a plain stream runs (unique per run: never cached)."""
    bodies: list[dict[str, Any]] = [
        {"structured_outputs": {"grammar": alternation(20_000, f"{run}g{i}")}}
        for i in range(num_grammars)]
    bodies += [{"structured_outputs": {"regex": f"{run}{r}"}} for r in STALL_REGEXES]
    bodies.append({"response_format": schema_format({"type": "object", "properties": {
        f"p{run}{i}": {"type": "string"} for i in range(100)}})})
    return bodies


STALL_FLOOR_S = 0.25  # a gap this much over the stream's longest alone is a stall, at least


def gaps(streams: list[list[float]]) -> dict[str, Any]:
    """Gaps between consecutive tokens within each stream of token arrival times (the five
    longest kept)."""
    deltas = sorted(b - a for times in streams for a, b in zip(times, times[1:], strict=False))
    if not deltas:
        return {"count": 0, "max_s": 0.0, "p99_s": 0.0, "p50_s": 0.0, "longest_s": []}
    return {"count": len(deltas), "max_s": round(deltas[-1], 4),
            "longest_s": [round(d, 4) for d in deltas[-5:]],
            "p99_s": round(deltas[min(len(deltas) - 1, len(deltas) * 99 // 100)], 4),
            "p50_s": round(deltas[len(deltas) // 2], 4)}


def stall_verdict(report: dict[str, Any]) -> dict[str, Any]:
    """The bound on a gap while the constraints compile (2x the longest gap alone or while the
    same requests arrive compiled, or the longest alone + STALL_FLOOR_S) and how many gaps
    passed it (a compile on the event loop: a gap of 0.4-4 s)."""
    alone = report["alone"]["max_s"]
    bound = max(2 * alone, 2 * report["with_cached_grammars"]["max_s"], alone + STALL_FLOOR_S)
    over = sum(1 for gap in report["with_grammars"]["longest_s"] if gap > bound)
    return {"bound_s": round(bound, 4), "gaps_over": over, "ok": over == 0}


Post = Callable[[dict[str, Any]], Awaitable[tuple[int, bytes]]]
Stream = Callable[[dict[str, Any], list[float]], Awaitable[None]]  # appends token times


async def stall_probe(post: Post, stream: Stream, plain: dict[str, Any], num_grammars: int,
                      run: str) -> dict[str, Any]:
    """A plain stream's token gaps alone, then while the stall shapes arrive (each asks for one
    token: what is measured is their compile, not their decoding). They are sent once the
    plain stream's first token came; the stream runs again until the last of them is answered,
    so every compile overlaps a stream."""
    times: list[float] = []
    await stream(plain, times)
    alone = gaps([times])
    bodies = stall_bodies(num_grammars, run)

    async def during(requests: list[dict[str, Any]]) -> tuple[list[list[float]],
                                                               list[tuple[int, bytes]], float]:
        streams: list[list[float]] = [[]]
        running = asyncio.ensure_future(stream(plain, streams[0]))
        while not streams[0] and not running.done():
            await asyncio.sleep(0.005)
        start = time.monotonic()
        arrivals = asyncio.ensure_future(asyncio.gather(
            *(post({**b, "max_tokens": 1}) for b in requests)))
        await running
        while not arrivals.done():
            streams.append([])
            await stream(plain, streams[-1])
        return streams, await arrivals, time.monotonic() - start

    streams, results, seconds = await during(bodies)
    loaded = gaps(streams)
    # the same requests again, compiled already (cache hits): what the requests cost the
    # stream besides their compiles (their bodies, their own engine steps)
    cached = gaps((await during(bodies))[0])
    return {"alone": alone, "with_grammars": loaded, "with_cached_grammars": cached,
            "streams_while_arriving": len(streams), "arrivals_s": round(seconds, 2),
            "grammar_statuses": [status for status, _ in results],
            "grammar_errors": [raw[:300].decode(errors="replace") for status, raw in results
                               if status != 200],
            "ratio_max": round(loaded["max_s"] / alone["max_s"], 2) if alone["max_s"] else None}


async def checked_stall_probe(post: Post, stream: Stream, plain: dict[str, Any],
                              num_grammars: int, run: str) -> dict[str, Any]:
    """stall_probe with its verdict, run a second time (new constraints) when a gap passed the
    bound: a busy shared machine's hiccup (one 0.3 s gap among thousands, seen in CI) rarely
    repeats; a compile on the event loop always does."""
    report = await stall_probe(post, stream, plain, num_grammars, run)
    report["verdict"] = stall_verdict(report)
    if report["verdict"]["ok"]:
        return report
    retry = await stall_probe(post, stream, plain, num_grammars, run + "-again")
    retry["verdict"] = stall_verdict(retry)
    retry["first_try"] = report
    return retry


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def memory_loop(post: Post, rss: Callable[[], int], num_schemas: int,
                      run: str) -> dict[str, Any]:
    """RSS before, after the first quarter (warm) and after all of `num_schemas` unique
    large-enum schemas."""
    before = rss()
    warm = after = before
    start = time.monotonic()
    statuses: dict[str, int] = {}
    for i in range(num_schemas):
        schema = unique_enum(i)
        schema["title"] = f"{run}-{i}"
        status, _ = await post({"response_format": schema_format(schema), "max_tokens": 1})
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if i + 1 == max(num_schemas // 4, 1):
            warm = rss()
    after = rss()
    return {"schemas": num_schemas, "statuses": statuses, "rss_before_mb": before >> 20,
            "rss_warm_mb": warm >> 20, "rss_after_mb": after >> 20,
            "growth_after_warm_mb": (after - warm) >> 20, "growth_mb": (after - before) >> 20,
            "seconds": round(time.monotonic() - start, 1)}


def body_json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


async def _main(args: Any) -> dict[str, Any]:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/")
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def post(body: dict[str, Any]) -> tuple[int, bytes]:
            async with http.post(url + "/v1/completions", json={"prompt": "x", **body}) as r:
                return r.status, await r.read()

        async def stream(body: dict[str, Any], times: list[float]) -> None:
            async with http.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        times.append(time.monotonic())

        run = f"{time.time():.0f}"
        plain = {"prompt": "Once upon a time", "ignore_eos": True, "temperature": 0,
                 "max_tokens": args.stream_tokens}
        report: dict[str, Any] = {}
        if args.grammars:
            report["stall"] = await checked_stall_probe(post, stream, plain, args.grammars, run)
        if args.unique_schemas and args.pid:
            report["memory"] = await memory_loop(post, lambda: rss_bytes(args.pid),
                                                 args.unique_schemas, run)
        return report


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The stall probe and the RSS loop against a "
                                                 "running server (no crash shapes: safe "
                                                 "against any server).")
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--pid", type=int, help="the server's process id (for its RSS)")
    parser.add_argument("--grammars", type=int, default=2)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--unique-schemas", type=int, default=40)
    print(json.dumps(asyncio.run(_main(parser.parse_args())), indent=1))

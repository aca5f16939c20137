"""An agent workload against an OpenAI-compatible server: N sessions x T turns, every turn's
prompt the whole session so far (a shared system prompt with tools, then each turn's user /
tool-result tokens and the assistant's reply), as token ids, so kvcore and llama.cpp's server
see exactly the same prompts. Sessions run at once, each turn after the previous one's answer.

    python tools/bench_agent.py --server "kvcore serve --port 8123 --num-blocks 1024 \\
        --max-num-seqs 4 --kv-offload-size 2GiB" --port 8123 --json out.json

Reports TTFT (first streamed text) p50 / p99 over turns >= 2 and over all turns, the wall
time, prompt + generated tokens per second, and the server's cached prompt tokens (kvcore's
usage) and KV tier counters (/metrics). --first-turn / --last-turn run a slice of the turns
(a restart: turns 1-4, restart the server with the same --kv-tier-dir, turns 5-8; the history
of earlier turns is replayed as the client would). The assistant's replies are synthetic
tokens of the workload (not the model's answer), so every server sees the same history.

llama.cpp's slot save/restore (--llama-slots N, with llama-server --slot-save-path DIR -np N):
each turn takes a free slot, restores its session's saved state into it, runs, saves it back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import pct  # noqa: E402


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[list[int]]],
                                                 list[list[list[int]]]]:
    """(system prompt, per session per turn: user tokens, per session per turn: reply)."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.token_id_min, args.vocab_size) for _ in range(n)]

    system = tokens(args.system_len)
    users = [[tokens(rng.randint(*args.turn_len)) for _ in range(args.turns)]
             for _ in range(args.sessions)]
    replies = [[tokens(rng.randint(*args.reply_len)) for _ in range(args.turns)]
               for _ in range(args.sessions)]
    return system, users, replies


def prompt_of(system: list[int], users: list[list[int]], replies: list[list[int]],
              turn: int) -> list[int]:
    """The prompt of turn `turn` (0-based): everything before it, then its user tokens."""
    out = list(system)
    for k in range(turn):
        out += users[k] + replies[k]
    return out + users[turn]


async def one_turn(http: aiohttp.ClientSession, args: argparse.Namespace, prompt: list[int],
                   slot: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}
    if slot is not None:
        body["id_slot"] = slot
    record: dict[str, Any] = {"prompt_tokens": len(prompt), "ttft": None, "tokens": None,
                              "cached_tokens": None, "error": None}
    chunks = 0
    start = time.perf_counter()
    async with http.post(f"{args.base_url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            record["error"] = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            record["tokens"] = 0
            return record
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage")
            choices = data.get("choices") or []
            if choices and choices[0].get("text"):
                chunks += 1
                if record["ttft"] is None:
                    record["ttft"] = time.perf_counter() - start
            if usage:  # the server's count (a chunk may hold no token's text, or several)
                details = usage.get("prompt_tokens_details") or {}
                record["cached_tokens"] = details.get("cached_tokens")
                record["tokens"] = usage.get("completion_tokens")
    if record["tokens"] is None:
        record["tokens"] = chunks
    record["e2e"] = time.perf_counter() - start
    return record


async def slot_action(http: aiohttp.ClientSession, args: argparse.Namespace, slot: int,
                      action: str, session: int) -> bool:
    async with http.post(f"{args.base_url}/slots/{slot}?action={action}",
                         json={"filename": f"session-{session}.bin"}) as resp:
        await resp.read()
        return resp.status == 200


async def run_sessions(args: argparse.Namespace) -> dict[str, Any]:
    system, users, replies = workload(args)
    records: list[dict[str, Any]] = []
    slots: asyncio.Queue[int] | None = None
    if args.llama_slots:
        slots = asyncio.Queue()
        for i in range(args.llama_slots):
            slots.put_nowait(i)
    saved: set[int] = set()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)

    # one connection per request: llama-server closes kept-alive connections after a stream
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        async def session(s: int) -> None:
            for turn in range(args.first_turn - 1, args.last_turn):
                prompt = prompt_of(system, users[s], replies[s], turn)
                start = time.perf_counter()
                slot = None if slots is None else await slots.get()
                try:
                    if slot is not None and s in saved:
                        await slot_action(http, args, slot, "restore", s)
                    before = time.perf_counter() - start  # waiting for a slot, restoring
                    record = await one_turn(http, args, prompt, slot)
                    if slot is not None and await slot_action(http, args, slot, "save", s):
                        saved.add(s)
                finally:
                    if slots is not None and slot is not None:
                        slots.put_nowait(slot)
                if record["ttft"] is not None:  # the turn as its user sees it
                    record["ttft"] += before
                record["turn_latency"] = time.perf_counter() - start
                records.append({"session": s, "turn": turn + 1, **record})

        if args.model is None:  # the server's first model
            async with http.get(f"{args.base_url}/v1/models") as resp:
                args.model = (await resp.json())["data"][0]["id"]
        for i in range(args.warmup):  # compiles and first-touch costs, outside the timing
            await one_turn(http, args, [args.token_id_min + i] * 64, None)
        metrics_before = await read_metrics(http, args.base_url)
        started = time.perf_counter()
        at_once = asyncio.Semaphore(args.max_concurrency or args.sessions)

        async def limited(s: int) -> None:
            async with at_once:  # sessions in flight at once (each runs all its turns)
                await session(s)
        tasks = [asyncio.ensure_future(limited(s)) for s in range(args.sessions)]
        _, pending = await asyncio.wait(tasks, timeout=args.time_limit)
        for task in pending:  # past --time-limit: report the turns that finished
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - started
        args.unfinished_sessions = len(pending)
        metrics_after = await read_metrics(http, args.base_url)
    return summarize(args, records, wall, metrics_before, metrics_after)


async def read_metrics(http: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """kvcore's counters (sums over labels); {} for a server without /metrics."""
    try:
        async with http.get(f"{base_url}/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvcore:") and " " in line:
            key, value = line.rsplit(" ", 1)
            name = key.split("{", 1)[0]
            if 'tier="' in key:
                name += "{" + key.split('tier="', 1)[1].split('"')[0] + "}"
            values[name] = values.get(name, 0.0) + float(value)
    return values


def summarize(args: argparse.Namespace, records: list[dict[str, Any]], wall: float,
              before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    errors = [r["error"] for r in records if r["error"]]
    later = [r["ttft"] for r in records if r["turn"] >= 2 and r["ttft"] is not None]
    every = [r["ttft"] for r in records if r["ttft"] is not None]
    first = [r["ttft"] for r in records if r["turn"] == args.first_turn and r["ttft"]]
    prompt_tokens = sum(r["prompt_tokens"] for r in records)
    generated = sum(r["tokens"] for r in records)
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    tiers = {k: after[k] - before.get(k, 0.0) for k in after
             if k.startswith("kvcore:kv_tier") and not k.startswith("kvcore:kv_tier_bytes")
             and "capacity" not in k and "seconds" not in k}
    return {
        "label": args.label, "sessions": args.sessions, "turns": [args.first_turn, args.last_turn],
        "num_turns": len(records), "errors": errors[:5], "num_errors": len(errors),
        "unfinished_sessions": getattr(args, "unfinished_sessions", 0),
        "wall_s": round(wall, 2),
        "ttft_p50_s_turns_ge2": round(pct(later, 50), 4) if later else None,
        "ttft_p99_s_turns_ge2": round(pct(later, 99), 4) if later else None,
        "ttft_p50_s": round(pct(every, 50), 4), "ttft_p99_s": round(pct(every, 99), 4),
        "ttft_p50_s_first_turn": round(pct(first, 50), 4) if first else None,
        "prompt_tokens": prompt_tokens, "generated_tokens": generated,
        "total_tokens_per_s": round((prompt_tokens + generated) / wall, 1),
        "generated_tokens_per_s": round(generated / wall, 2),
        "cached_prompt_tokens": sum(cached) if cached else None,
        "preemptions": after.get("kvcore:num_preemptions_total", 0.0) - before.get(
            "kvcore:num_preemptions_total", 0.0),
        "tiers": tiers, "records": records,
    }


def start_server(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    log = open(args.server_log, "ab")  # noqa: SIM115  (the server's lifetime)
    proc = subprocess.Popen(shlex.split(args.server), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.server_timeout
    import urllib.error
    import urllib.request
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} (see {args.server_log})")
        try:
            with urllib.request.urlopen(f"{args.base_url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {args.server_timeout} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)  # kvcore drains and lets its tiers' writes land
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", help="a running server (default: http://127.0.0.1:PORT)")
    p.add_argument("--server", help="start this server command, run, stop it (SIGTERM)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--server-log", default="/tmp/bench_agent_server.log")
    p.add_argument("--server-timeout", type=float, default=600.0)
    p.add_argument("--model", help="the model name to send (default: the server's first)")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="sessions in flight at once (default: all)")
    p.add_argument("--first-turn", type=int, default=1)
    p.add_argument("--last-turn", type=int, default=None)
    p.add_argument("--system-len", type=int, default=1500, help="system prompt + tools tokens")
    p.add_argument("--turn-len", type=int, nargs=2, default=(150, 400), metavar=("MIN", "MAX"))
    p.add_argument("--reply-len", type=int, nargs=2, default=(40, 80), metavar=("MIN", "MAX"),
                   help="the assistant's reply appended to the history (synthetic tokens)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed 64-token requests first (not sharing the workload's prefix)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop after this many seconds and report the turns that finished")
    p.add_argument("--llama-slots", type=int, default=0,
                   help="llama-server slot save/restore around every turn (its -np)")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--token-id-min", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    args.base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    args.last_turn = args.last_turn or args.turns
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    proc = start_server(args) if args.server else None
    try:
        report = asyncio.run(run_sessions(args))
    finally:
        if proc is not None:
            stop_server(proc)
    if args.json:  # with every turn's record
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "records"}, indent=1))
    return report


if __name__ == "__main__":
    main()

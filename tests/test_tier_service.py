"""The KV tiers as a server shows them: /metrics (restored tokens, bytes, writes, dropped
writes, load / store seconds per tier), the request log line (tokens restored per tier) and the
KV inspector's snapshot (each tier's occupancy); `kvcore serve`'s flags build the TierConfig."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import structlog
from aiohttp import web

from kvcore.cache.tiers.disk import shared_secret
from kvcore.cli import build_parser
from kvcore.cli.serve import _config, salt_secret
from kvcore.config_tiers import TierConfig
from kvcore.engine import AsyncEngine, Engine
from kvcore.service import make_app
from service_fixtures import MODEL_NAME, tiny_config

RNG = np.random.default_rng(11)
LONG = RNG.integers(3, 259, 60).tolist()
FLOOD = [RNG.integers(3, 259, 60).tolist() for _ in range(3)]


def tier_app(model_dir: Path) -> web.Application:
    config = dataclasses.replace(tiny_config(model_dir, num_blocks=40, max_num_seqs=1),
                                 tiers=TierConfig(kv_offload_size=1 << 22))
    return make_app(AsyncEngine(Engine(config)), served_model_name=MODEL_NAME)


async def complete(client, prompt: list[int], key: str | None = None) -> None:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    resp = await client.post("/v1/completions", headers=headers, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert resp.status == 200, await resp.text()


@pytest.mark.asyncio
async def test_metrics_log_line_and_inspector_show_the_tiers(aiohttp_client,
                                                             tiny_model_dir: Path) -> None:
    client = await aiohttp_client(tier_app(tiny_model_dir))
    await complete(client, LONG)
    for prompt in FLOOD:  # the pool (40 blocks of 4) forgets LONG; the host tier keeps it
        await complete(client, prompt)
    with structlog.testing.capture_logs() as logs:
        await complete(client, LONG + [5, 6])
    (line,) = [e for e in logs if e["event"] == "request"]
    assert line["restored_tokens"]["host"] > 0
    assert line["cached_tokens"] >= line["restored_tokens"]["host"]
    text = await (await client.get("/metrics")).text()

    def metric(name: str, tier: str = "host") -> float:
        match = re.search(rf'^kvcore:{name}{{model_name="{MODEL_NAME}",tier="{tier}"}} (\S+)$',
                          text, re.M)
        assert match, name
        return float(match.group(1))
    assert metric("kv_tier_hits_total") == line["restored_tokens"]["host"]
    assert metric("kv_tier_bytes") > 0 and metric("kv_tier_capacity_bytes") == 1 << 22
    assert metric("kv_tier_stores_total") > 0 and metric("kv_tier_dropped_writes_total") == 0
    assert re.search(r'^kvcore:kv_tier_load_seconds_count\{model_name="tiny"\} [1-9]', text,
                     re.M)
    assert re.search(r'^kvcore:kv_tier_store_seconds_count\{model_name="tiny"\} [1-9]', text,
                     re.M)
    assert "kvcore:kv_tier_load_failures_total" in text
    snapshot = None
    for _ in range(50):  # the driver publishes once asked
        snapshot = await (await client.get("/debug/kv")).json()
        if snapshot.get("tiers"):
            break
    assert snapshot is not None and snapshot["tiers"]["tiers"]["host"]["pages"] > 0
    assert snapshot["tiers"]["tiers"]["host"]["capacity_bytes"] == 1 << 22


@pytest.mark.asyncio
async def test_no_tier_no_tier_metrics(aiohttp_client, tiny_model_dir: Path) -> None:
    config = tiny_config(tiny_model_dir)
    client = await aiohttp_client(make_app(AsyncEngine(Engine(config)),
                                           served_model_name=MODEL_NAME))
    await complete(client, LONG)
    assert "kv_tier" not in await (await client.get("/metrics")).text()


def test_serve_flags_build_the_tier_config(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "serve", "--kv-offload-size", "2GiB", "--kv-offload-dtype", "int4", "--kv-tier-dir",
        str(tmp_path), "--kv-tier-disk-size", "5GB", "--kv-tier-write-policy", "write_back",
        "--preemption-mode", "recompute"])
    tiers = _config(args, "model-dir").tiers
    assert tiers == TierConfig(kv_offload_size=2 * 2**30, kv_offload_dtype="int4",
                               kv_tier_dir=str(tmp_path), kv_tier_disk_size=5 * 10**9,
                               kv_tier_write_policy="write_back", preemption_mode="recompute")
    assert not _config(build_parser().parse_args(["serve"]), "m").tiers.enabled


@pytest.mark.asyncio
async def test_a_restarted_server_finds_its_tenants_pages_on_disk(aiohttp_client,
                                                                  tiny_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """Tenants' cache salts come from the tier directory's secret (a per-process secret would
    name every block differently after a restart); another tenant still finds nothing."""
    config = dataclasses.replace(tiny_config(tiny_model_dir, num_blocks=40, max_num_seqs=1),
                                 tiers=TierConfig(kv_tier_dir=str(tmp_path)))
    keys = {"key-a": "alice", "key-b": "bob"}

    def app() -> web.Application:
        return make_app(AsyncEngine(Engine(config)), served_model_name=MODEL_NAME,
                        api_keys=keys, cache_salt_secret=salt_secret(config))
    first = await aiohttp_client(app())
    await complete(first, LONG, "key-a")
    await first.close()  # drains: queued page writes land
    second = await aiohttp_client(app())
    with structlog.testing.capture_logs() as logs:
        await complete(second, LONG + [5], "key-b")
        await complete(second, LONG + [6], "key-a")
    bob, alice = [e for e in logs if e["event"] == "request"]
    assert bob["restored_tokens"] is None and bob["cached_tokens"] == 0
    assert alice["restored_tokens"]["disk"] >= len(LONG) // 4 * 4 - 4


def test_the_tier_directorys_secret_is_made_once(tmp_path: Path) -> None:
    secret = shared_secret(tmp_path)
    assert secret is not None and len(secret) == 32
    assert shared_secret(tmp_path) == secret
    assert (tmp_path / "salt.secret").stat().st_mode & 0o777 == 0o600
    assert shared_secret(tmp_path / "salt.secret" / "x") is None  # not a directory


def test_bench_agent_runs_its_sessions_against_a_tier_server(tiny_model_dir: Path) -> None:
    """tools/bench_agent.py end to end: every turn answered, later turns find their history
    in the pool or the host tier (the pool, 160 tokens, holds about two sessions)."""
    import sys

    from service_live import live_server

    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    import bench_agent

    with live_server(lambda: tier_app(tiny_model_dir)) as server:
        report = bench_agent.main([
            "--base-url", server.url, "--sessions", "3", "--turns", "3", "--system-len", "30",
            "--turn-len", "12", "20", "--reply-len", "4", "8", "--max-tokens", "2",
            "--vocab-size", "259", "--token-id-min", "3", "--warmup", "0"])
    assert report["num_errors"] == 0 and report["num_turns"] == 9
    assert all(r["tokens"] == 2 for r in report["records"])
    assert sorted((r["session"], r["turn"]) for r in report["records"]) == [
        (s, t) for s in range(3) for t in (1, 2, 3)]
    assert report["ttft_p50_s_turns_ge2"] > 0 and report["cached_prompt_tokens"] > 0
    assert report["tiers"]["kvcore:kv_tier_hits_total{host}"] > 0

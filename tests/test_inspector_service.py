"""/inspector and /debug/kv over HTTP: open without keys, admin keys only with them (401/403),
tenant names and no content in the snapshot, and the keys file's admin marking."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kvcore.service.auth import read_keys_file
from service_fixtures import tiny_app

pytestmark = pytest.mark.asyncio

KEYS = {"user-key": "alice", "ops-key": "ops"}
PROMPT = "the quick brown fox jumps over the lazy dog"


def basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"me:{password}".encode()).decode()}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_open_without_keys(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir))
    resp = await client.get("/inspector")
    assert resp.status == 200 and resp.content_type == "text/html"
    page = await resp.text()
    assert "kvInspector" in page and "<canvas" in page
    assert "http://" not in page and "https://" not in page  # no CDN: works offline
    resp = await client.get("/debug/kv")
    assert resp.status == 200 and resp.headers["Cache-Control"] == "no-store"
    data = await resp.json()
    assert data["num_blocks"] == 96 and data["counts"]["free"] == 96
    assert len(base64.b64decode(data["blocks"])) == 96 and data["requests"] == []
    assert data["planner"]["bytes_per_token"] == 256 and data["tenants"] == {}  # fp16 cache


@pytest.mark.parametrize("path", ["/inspector", "/debug/kv"])
async def test_admin_key_required_when_keys_are_configured(aiohttp_client, tiny_model_dir,
                                                           path: str) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, api_keys=KEYS,
                                           admin_keys=["ops-key", "root-key"]))
    for headers in ({}, bearer("nope"), basic("nope"), {"Authorization": "Basic !!"}):
        resp = await client.get(path, headers=headers)
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Basic realm=")  # the login dialog
        error = (await resp.json())["error"]
        assert error["type"] == "AuthenticationError" and error["code"] == "invalid_api_key"
    for headers in (bearer("user-key"), basic("user-key")):
        resp = await client.get(path, headers=headers)
        assert resp.status == 403
        error = (await resp.json())["error"]
        assert error["type"] == "PermissionDeniedError" and error["code"] == "permission_denied"
        assert "admin key" in error["message"]
    for headers in (bearer("ops-key"), basic("ops-key"), bearer("root-key")):
        assert (await client.get(path, headers=headers)).status == 200
    # the admin-only key is also a tenant of its own ("admin<i>"), Bearer only for the API
    body = {"prompt": "hi", "max_tokens": 1}
    assert (await client.post("/v1/completions", json=body,
                              headers=bearer("root-key"))).status == 200
    assert (await client.post("/v1/completions", json=body,
                              headers=basic("root-key"))).status == 401


async def test_snapshot_names_tenants_and_never_content(aiohttp_client, tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir, api_keys=KEYS, admin_keys=["ops-key"],
                                           engine_kwargs={"max_model_len": 512,
                                                          "num_blocks": 300}))
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 2}
    resp = await client.post("/v1/completions", json=body, headers=bearer("user-key"))
    assert resp.status == 200
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    chunk = json.loads(first[6:])
    raw = await (await client.get("/debug/kv", headers=bearer("ops-key"))).read()
    data = json.loads(raw)
    groups = {r["group"] for r in data["requests"]}
    assert len(groups) == 1 and chunk["id"] in next(iter(groups))
    assert data["tenants"] == {next(iter(groups)): "alice"}
    assert {r["id"] for r in data["requests"]} == {f"{chunk['id']}-0", f"{chunk['id']}-0#n1"}
    text = raw.decode()
    for secret in ("user-key", "ops-key", "quick", "fox", '"prompt"', '"text"', "hash", "salt"):
        assert secret not in text
    resp.close()


def test_keys_file_admin_marking(tmp_path: Path) -> None:
    (tmp_path / "keys.txt").write_text("# ops\nk1 alice\nk2 ops admin\n\n")
    assert read_keys_file(tmp_path / "keys.txt") == ({"k1": "alice", "k2": "ops"}, {"k2"})
    (tmp_path / "keys.json").write_text(json.dumps(
        {"k1": "alice", "k2": {"tenant": "ops", "admin": True}, "k3": {"tenant": "bob"}}))
    assert read_keys_file(tmp_path / "keys.json") == (
        {"k1": "alice", "k2": "ops", "k3": "bob"}, {"k2"})
    for bad in ("k1 alice root\n", "k1 alice admin extra\n"):
        (tmp_path / "bad.txt").write_text(bad)
        with pytest.raises(ValueError, match="KEY TENANT admin"):
            read_keys_file(tmp_path / "bad.txt")
    (tmp_path / "bad.json").write_text(json.dumps({"k1": {"tenant": "a", "admin": "yes"}}))
    with pytest.raises(ValueError, match="non-empty strings"):
        read_keys_file(tmp_path / "bad.json")


def test_admin_keys_must_be_keys() -> None:
    from kvcore.service.auth import TenantAuth

    with pytest.raises(ValueError, match="admin_keys"):
        TenantAuth({"k": "a"}, admin_keys=["other"])


async def test_a_replica_asked_of_a_single_engine_is_400_naming_it(aiohttp_client,
                                                                    tiny_model_dir) -> None:
    client = await aiohttp_client(tiny_app(tiny_model_dir))
    resp = await client.get("/debug/kv", params={"replica": "r1"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "replica"
    data = await (await client.get("/debug/kv")).json()
    assert "replicas" not in data  # one engine: the page shows no replica selector

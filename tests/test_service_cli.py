"""`kvcore serve` as a process: startup log (pool, concurrency), auth, SIGTERM drains, exit 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

SERVE = [sys.executable, "-c", "import sys; from kvcore.cli import main; sys.exit(main())", "serve"]


def _post(url: str, body: dict[str, Any], key: str | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _events(proc: subprocess.Popen[str], until: str) -> list[dict[str, Any]]:
    events = []
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("{"):
            events.append(json.loads(line))
            if events[-1]["event"] == until:
                return events
    raise AssertionError(f"the server exited before logging {until!r}: {events}")


def test_serve_process(tiny_model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("kfile tenant-f\nkops ops admin\n")
    proc = subprocess.Popen(
        [*SERVE, str(tiny_model_dir), "--port", "0", "--api-key", "k1", "--api-keys-file",
         str(keys), "--block-size", "4", "--num-blocks", "64", "--max-model-len", "128",
         "--max-num-seqs", "8", "--device", "cpu", "--drain-timeout", "30",
         "--served-model-name", "tiny", "--admin-key", "kadm"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        events = _events(proc, "serving")
        url = events[-1]["url"]
        events += _events(proc, "engine ready")
        pool = events[-1]
        # the library's own log lines (kvcore.logs) come out as the CLI's JSON lines too
        assert any(e["event"] == "kv cache pool" and e["level"] == "info" for e in events)
        # 64 blocks of 4 tokens; a sequence of max_model_len=128 needs 32 of them
        assert pool["num_blocks"] == 64 and pool["max_concurrency"] == 2
        assert pool["pool_size"] == "64 KiB"  # 64 x 4 tokens x (2 x 2 layers x 2 heads x 16 x 2 B)
        for _ in range(600):  # the model loads in the background; /health is 503 until then
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except urllib.error.HTTPError as e:
                assert e.code == 503
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True}
        assert _post(f"{url}/v1/completions", body)[0] == 401
        # the KV inspector: admin keys only (--admin-key, or marked in the keys file)
        for key, expected in ((None, 401), ("k1", 403), ("kops", 200), ("kadm", 200)):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        f"{url}/debug/kv", headers=headers), timeout=30) as resp:
                    status = resp.status
            except urllib.error.HTTPError as e:
                status = e.code
            assert status == expected, key
        status, raw = _post(f"{url}/v1/completions", body, key="kfile")
        assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4
        # a stream in flight when SIGTERM arrives still finishes (drain), then the process exits
        result: dict[str, Any] = {}
        headers_in = threading.Event()

        def stream() -> None:
            request = urllib.request.Request(
                f"{url}/v1/completions",
                json.dumps(body | {"max_tokens": 100, "stream": True}).encode(),
                {"Content-Type": "application/json", "Authorization": "Bearer k1"})
            with urllib.request.urlopen(request, timeout=60) as resp:
                headers_in.set()  # headers come with the first token: the request is in flight
                result["answer"] = (resp.status, resp.read())

        client = threading.Thread(target=stream)
        client.start()
        request_logs = _events(proc, "request")  # the first call's line
        assert request_logs[-1]["tenant"] == "tenant-f"
        assert headers_in.wait(60)
        proc.send_signal(signal.SIGTERM)
        rest = _events(proc, "drained")
        assert rest[-1]["aborted"] == 0
        client.join(60)
        status, raw = result["answer"]
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""`kvcore serve --kv-cache-dtype int4` as a process on the CPU: the pool it logs (blocks and
the fp16 window), completions with n > 1, /metrics naming the dtype, SIGTERM exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from kvcore.cache.int4_window import num_window_slots
from kvcore.planner import bytes_per_block, format_size, window_bytes
from test_service_cli import SERVE, _events, _post


def test_serve_int4(tiny_model_dir: Path) -> None:
    proc = subprocess.Popen(
        [*SERVE, str(tiny_model_dir), "--port", "0", "--block-size", "4", "--num-blocks", "64",
         "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
         "--device", "cpu", "--served-model-name", "tiny", "--kv-cache-dtype", "int4",
         "--kv-int4-window", "8", "--drain-timeout", "30"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        url = _events(proc, "serving")[-1]["url"]
        pool = _events(proc, "engine ready")[-1]
        assert pool["cache_dtype"] == "int4" and pool["num_blocks"] == 64
        # tiny model: 2 layers x 2 KV heads x head_dim 16 (one int4 group per head)
        slots = num_window_slots(8, 8, 4, 32)
        expected = 64 * bytes_per_block(2, 2, 16, "int4", 4) + window_bytes(2, 2, 16, slots, 4)
        assert pool["pool_size"] == format_size(expected)
        for _ in range(600):  # the model loads in the background; /health is 503 until then
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except urllib.error.HTTPError as e:
                assert e.code == 503
        body = {"model": "tiny", "prompt": "the cache holds four bits " * 4, "max_tokens": 24,
                "n": 2, "ignore_eos": True, "temperature": 0.8, "seed": 1}
        status, raw = _post(f"{url}/v1/completions", body)
        answer = json.loads(raw)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 48 and len(answer["choices"]) == 2
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            metrics = resp.read().decode()
        assert 'cache_dtype="int4"' in metrics
        # /metrics and the planner agree on the pool's bytes (rows, window and slot table)
        gauge = [line for line in metrics.splitlines()
                 if line.startswith("kvcore:kv_cache_bytes{")]
        assert len(gauge) == 1 and float(gauge[0].rsplit(" ", 1)[1]) == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""Start-up time of `kvcore serve`: seconds from the process's start to the first 200 from
/health (the model loaded, numba's kernels compiled or loaded from its disk cache), for a first
start on an empty numba cache and for the starts after it on the same cache.

    .venv/bin/python tools/bench_startup.py [--json] [--starts 2] [--model DIR] [--cache-dir D]

Each start is a fresh `kvcore serve --port 0` process (the default model unless --model),
stopped with SIGTERM once healthy; NUMBA_CACHE_DIR is a new empty directory (or --cache-dir,
which is emptied first) shared by the starts. The CPU and the load average come with the figures:
on a busy machine they move a lot.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def start_once(model: str | None, cache_dir: Path, timeout: float) -> float:
    """Seconds until the server answers /health with 200."""
    command = [sys.executable, "-c", "import sys; from kvcore.cli import main; sys.exit(main())",
               "serve", "--port", "0", "--device", "cpu"]
    if model is not None:
        command.insert(4, model)  # after "serve"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:  # the JSON line that names the URL (the port is any free one)
            if line.startswith("{") and json.loads(line).get("event") == "serving":
                url = json.loads(line)["url"]
                break
        if url is None:
            raise RuntimeError(f"kvcore serve exited with {proc.wait()} before serving")
        while time.perf_counter() - start < timeout:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"not healthy within {timeout} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=2, help="starts on one cache (default 2)")
    parser.add_argument("--model", help="model directory (default: the default model)")
    parser.add_argument("--cache-dir", type=Path, help="NUMBA_CACHE_DIR to use (emptied first)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per start")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.starts < 1:
        raise ValueError(f"starts must be >= 1, got {args.starts}")
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="kvcore-numba-"))
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    load = os.getloadavg()[0]
    seconds = [round(start_once(args.model, cache_dir, args.timeout), 1)
               for _ in range(args.starts)]
    report = {"model": args.model or "default", "first_start_s": seconds[0],
              "later_starts_s": seconds[1:], "cpu": _cpu_model(), "cores": os.cpu_count(),
              "load_average_before": round(load, 2)}
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return report


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()

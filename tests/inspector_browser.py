"""Helpers of the KV inspector's browser test: Debian's headless Chromium through Selenium, and
clients that keep requests in flight against a live server."""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
STATES = ("free", "cached", "used", "shared")


@contextmanager
def chromium(user_data_dir: Path) -> Iterator[Any]:
    """A headless Chromium (never a downloaded one); skips when Debian's package is missing,
    unless KVCORE_REQUIRE_BROWSER=1 (CI installs it and must not skip)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        message = "needs Debian's chromium and chromium-driver (apt-get install -y chromium " \
                  "chromium-driver; .ci/run does it)"
        if os.environ.get("KVCORE_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={user_data_dir}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


@contextmanager
def requests_in_flight(base_url: str, num_clients: int, prefix: list[int], max_tokens: int,
                       n_every: int = 2) -> Iterator[list[int]]:
    """`num_clients` threads send completions back to back until the block exits: every prompt
    starts with `prefix` (full blocks shared through the prefix cache) and every `n_every`-th
    asks n=2 (forked sequences share the prompt's blocks; the first decode copies the partial
    last block). Yields the list of completed calls per client (for the test's checks)."""
    stop = threading.Event()
    done = [0] * num_clients
    errors: list[BaseException] = []

    def client(i: int) -> None:
        call = 0
        while not stop.is_set():
            body = {"prompt": prefix + [100 + i, 150 + call % 50, 7], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 1.0, "seed": call,
                    "n": 2 if (i + call) % n_every == 0 else 1}
            try:
                post_json(f"{base_url}/v1/completions", body)
            except BaseException as e:  # noqa: BLE001  # reported after the block
                errors.append(e)
                return
            call += 1
            done[i] = call

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(num_clients)]
    for thread in threads:
        thread.start()
    try:
        yield done
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    if errors:
        raise errors[0]


def count_states(blocks_b64: str) -> dict[str, int]:
    """Cells per state from /debug/kv's block map, decoded here independently of the page."""
    counts = dict.fromkeys(STATES, 0)
    for byte in base64.b64decode(blocks_b64):
        counts[STATES[byte & 3]] += 1
    return counts


def owners_of(snapshot: dict[str, Any], block_id: int) -> list[str]:
    """The request ids whose block table holds block_id, from the runs of the snapshot."""
    out = []
    for request in snapshot["requests"]:
        for first, count in request["blocks"]:
            if first is None:
                continue
            ids = range(first, first + count) if count > 0 else range(first, first + count, -1)
            if block_id in ids:
                out.append(request["id"])
    return out

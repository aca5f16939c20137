"""docs/inspector.png: the KV inspector of a real server (the default model on CPU) with requests in
flight, two tenants sharing prompt prefixes and some n = 2 requests, in Debian's headless Chromium.

    .venv/bin/python tools/inspector_screenshot.py [--out docs/inspector.png] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from inspector_browser import chromium  # noqa: E402

KEYS = {"key-alice": "alice", "key-bob": "bob", "key-ops": "ops"}


def client(url: str, key: str, prefix: list[int], i: int, stop: threading.Event) -> None:
    call = 0
    while not stop.is_set():
        body = {"prompt": prefix + [1000 + 37 * i + call, 2000 + i], "max_tokens": 48 + 8 * i,
                "ignore_eos": True, "temperature": 0.8, "seed": call, "n": 2 if i % 3 == 0 else 1}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=600) as resp:
            resp.read()
        call += 1


async def main(args: argparse.Namespace) -> None:
    from aiohttp import web

    from kvcore.engine import AsyncEngine
    from kvcore.engine.llm import engine_config
    from kvcore.model.hub import resolve_model
    from kvcore.service import make_app

    model_dir = resolve_model(None)
    ae = AsyncEngine.from_config(engine_config(str(model_dir), device="cpu"))
    app = make_app(ae, api_keys=KEYS, admin_keys=["key-ops"],
                   served_model_name=model_dir.name)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    system = list(range(500, 700))  # a 200-token "system prompt" shared within each tenant
    stop = threading.Event()
    threads = [threading.Thread(target=client, daemon=True,
                                args=(url, key, [t * 7 for t in system] if key == "key-bob"
                                      else system, i, stop))
               for i, key in enumerate(["key-alice"] * 7 + ["key-bob"] * 4)]
    for thread in threads:
        thread.start()
    await asyncio.to_thread(screenshot, url, args)
    stop.set()
    await runner.cleanup()


def screenshot(url: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as profile, chromium(Path(profile)) as driver:
        driver.set_window_size(1400, 1150)
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders",
                               {"headers": {"Authorization": "Bearer key-ops"}})
        driver.get(f"{url}/inspector")
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            time.sleep(1)
        # select a request of an n = 2 pair, then hover a block it shares
        target = driver.execute_script("""
            const snap = kvInspector.last;
            const req = snap.requests.find((r) => r.id.endsWith('#n1')) || snap.requests[0];
            const shared = new Set(snap.shared.map((p) => p[0]));
            const table = expandRuns(req.blocks);
            return [req.id, table.find((b) => shared.has(b)) ?? table[0]];""")
        driver.find_element("css selector", f"#requests tr[data-id='{target[0]}']").click()
        driver.find_element("id", "pause").click()
        from selenium.webdriver.common.action_chains import ActionChains

        canvas = driver.find_element("id", "map")
        center = driver.execute_script("return kvInspector.cellCenter(arguments[0]);", target[1])
        rect = driver.execute_script("return arguments[0].getBoundingClientRect().toJSON();",
                                     canvas)
        ActionChains(driver).move_to_element_with_offset(
            canvas, int(center["x"] - rect["left"] - rect["width"] / 2),
            int(center["y"] - rect["top"] - rect["height"] / 2)).perform()
        time.sleep(0.5)
        driver.save_screenshot(str(args.out))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        print(f"saved {args.out}; browser errors: {errors}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/inspector.png"))
    parser.add_argument("--seconds", type=float, default=40.0,
                        help="how long the requests run before the screenshot")
    logging.basicConfig(level=logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    asyncio.run(main(parser.parse_args()))

"""The KV inspector page in a real headless Chromium, against a live server with requests on."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from inspector_browser import (
    chromium,
    count_states,
    get_json,
    owners_of,
    requests_in_flight,
)
from service_fixtures import engine_of, tiny_app
from service_live import live_server

PREFIX = list(range(20, 44))  # 6 full blocks of 4 tokens in every prompt


def wait_for(driver: Any, script: str, timeout: float = 20.0) -> Any:
    """Poll a JS expression until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {script};")
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {script}")
        time.sleep(0.05)


def click_pause(driver: Any) -> None:
    driver.find_element("id", "pause").click()


def browser_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def hover_block(driver: Any, block_id: int) -> str:
    from selenium.webdriver.common.action_chains import ActionChains

    canvas = driver.find_element("id", "map")
    center = driver.execute_script("return kvInspector.cellCenter(arguments[0]);", block_id)
    rect = driver.execute_script("return arguments[0].getBoundingClientRect().toJSON();", canvas)
    dx = center["x"] - (rect["left"] + rect["width"] / 2)
    dy = center["y"] - (rect["top"] + rect["height"] / 2)
    ActionChains(driver).move_to_element_with_offset(canvas, int(dx), int(dy)).perform()
    wait_for(driver, "document.getElementById('tooltip').style.display === 'block'")
    assert driver.execute_script("return document.getElementById('tooltip').dataset.block;") \
        == str(block_id)
    return driver.find_element("id", "tooltip").text


def test_inspector_page_live_in_chromium(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine_kwargs = {"num_blocks": 160, "max_model_len": 128, "max_num_batched_tokens": 32}
    with live_server(lambda: tiny_app(tiny_model_dir, engine_kwargs=engine_kwargs)) as server, \
            chromium(tmp_path / "chromium-profile") as driver:
        with requests_in_flight(server.url, num_clients=4, prefix=PREFIX, max_tokens=60):
            driver.get(f"{server.url}/inspector")
            # two live updates without a reload
            wait_for(driver, "kvInspector.updates >= 2")
            first = driver.execute_script("return kvInspector.last.seq;")
            wait_for(driver, f"kvInspector.last.seq > {first}")
            # pause on a snapshot with a shared block (prefix hits or n=2 forks); the page
            # then keeps that snapshot still while the mouse hovers
            for _ in range(40):
                click_pause(driver)
                snapshot = driver.execute_script("return kvInspector.last;")
                if snapshot["counts"]["shared"] and snapshot["requests"]:
                    break
                click_pause(driver)
                seq = snapshot["seq"]
                wait_for(driver, f"kvInspector.last.seq > {seq}")
            else:
                raise AssertionError("no snapshot with a shared block")
            drawn = driver.execute_script("return kvInspector.drawnCounts;")
            assert drawn == snapshot["counts"] == count_states(snapshot["blocks"])
            legend = {s: driver.find_element("id", f"count-{s}").text.replace(",", "")
                      for s in drawn}
            assert legend == {s: str(v) for s, v in drawn.items()}
            block_id, ref_count = snapshot["shared"][0]
            owners = owners_of(snapshot, block_id)
            assert len(owners) == ref_count >= 2
            text = hover_block(driver, block_id)
            assert f"block {block_id} · shared" in text and f"refcount {ref_count}" in text
            for owner in owners:
                assert owner in text
            assert "tenant: anonymous" in text
            # clicking a request highlights its block table
            row = f"#requests tr[data-id='{owners[0]}']"
            driver.find_element("css selector", row).click()  # the table is re-rendered
            assert "sel" in driver.find_element("css selector", row).get_attribute("class")
            assert driver.execute_script("return kvInspector.selected;") == owners[0]
            table = next(r["blocks"] for r in snapshot["requests"] if r["id"] == owners[0])
            expected = [b for first, count in table for b in (
                range(first, first + count) if count > 0 else range(first, first + count, -1))]
            assert driver.execute_script("return kvInspector.selectedTable;") == expected
            rows = driver.find_elements("css selector", "#requests tr")
            assert len(rows) == len(snapshot["requests"])
            driver.save_screenshot(str(tmp_path / "inspector.png"))
            click_pause(driver)
        # idle: the page and a fresh /debug/kv agree cell for cell
        deadline = time.monotonic() + 20
        while engine_of(server.app).stats().num_running or engine_of(server.app).stats(
                ).num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        data = get_json(f"{server.url}/debug/kv")
        wait_for(driver, f"kvInspector.last.seq >= {data['seq'] + 1}")
        data = get_json(f"{server.url}/debug/kv")
        wait_for(driver, f"kvInspector.last.seq >= {data['seq']}")
        drawn = driver.execute_script("return kvInspector.drawnCounts;")
        assert drawn == data["counts"] == count_states(data["blocks"])
        assert data["counts"]["cached"] > 0 and data["counts"]["used"] == 0
        assert data["totals"]["cow_copies"] > 0  # the n=2 requests copied on write
        assert data["totals"]["prefix_cache_hits"] > 0
        series = driver.execute_script("return kvInspector.last.series;")
        assert len(series["t"]) >= 1 and max(series["tokens_per_s"]) > 0
        assert browser_errors(driver) == []
        assert (tmp_path / "inspector.png").stat().st_size > 10_000


def test_inspector_page_renders_a_20k_block_pool(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine_kwargs = {"num_blocks": 20_000, "max_model_len": 128}
    with live_server(lambda: tiny_app(tiny_model_dir, engine_kwargs=engine_kwargs)) as server, \
            chromium(tmp_path / "chromium-profile") as driver:
        with requests_in_flight(server.url, num_clients=2, prefix=PREFIX, max_tokens=40):
            driver.get(f"{server.url}/inspector")
            wait_for(driver, "kvInspector.updates >= 2")
        click_pause(driver)
        snapshot = driver.execute_script("return kvInspector.last;")
        drawn = driver.execute_script("return kvInspector.drawnCounts;")
        assert snapshot["num_blocks"] == 20_000
        assert drawn == snapshot["counts"] and sum(drawn.values()) == 20_000
        size = driver.execute_script(
            "const c = document.getElementById('map'); return [c.width, c.height, "
            "kvInspector.cols, kvInspector.cell];")
        width, height, cols, cell = size
        assert cols * cell == width and -(-20_000 // cols) * cell == height and cell >= 1
        text = hover_block(driver, 19_999)  # the last cell is on the map and answers
        assert "block 19999" in text
        driver.save_screenshot(str(tmp_path / "inspector-20k.png"))
        assert browser_errors(driver) == []


def test_inspector_opened_with_credentials_in_the_url(tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    """N6: opened as http://admin:KEY@host:port/inspector (Basic auth in the URL), the page polls
    /debug/kv by origin and path, never with the URL's credentials, and shows the pool."""
    import json
    import urllib.request

    key = "sk-inspector-admin"
    with live_server(lambda: tiny_app(tiny_model_dir, admin_keys=[key])) as server, \
            chromium(tmp_path / "chromium-profile") as driver:
        body = json.dumps({"prompt": PREFIX, "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{server.url}/v1/completions", body, {
            "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200  # its prompt's blocks stay cached
        driver.get(f"http://admin:{key}@127.0.0.1:{server.port}/inspector")
        wait_for(driver, "kvInspector.updates >= 2")
        snapshot = driver.execute_script("return kvInspector.last;")
        drawn = driver.execute_script("return kvInspector.drawnCounts;")
        assert drawn == snapshot["counts"] and sum(drawn.values()) == snapshot["num_blocks"]
        assert drawn["cached"] > 0
        assert driver.find_element("id", "replica-pick").get_attribute("hidden") is not None
        assert browser_errors(driver) == []

"""Speculative decoding through the service: vLLM's spec_decode metrics under `kvcore:`, and the
request log line carries the request's acceptance."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import structlog

from kvcore.engine import AsyncEngine, Engine
from kvcore.service import make_app
from kvcore.speculation import SpeculativeConfig
from service_fixtures import MODEL_NAME, tiny_config

pytestmark = pytest.mark.asyncio


async def test_metrics_and_log_line(aiohttp_client: Any, tiny_model_dir: Path) -> None:
    config = dataclasses.replace(tiny_config(tiny_model_dir), speculative=SpeculativeConfig(
        prompt_lookup_min=1, prompt_lookup_max=2))
    engine = Engine(config)
    client = await aiohttp_client(make_app(AsyncEngine(engine), served_model_name=MODEL_NAME))
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    with structlog.testing.capture_logs() as logs:
        assert (await client.post("/v1/completions", json=body)).status == 200
    spec = engine.stats().spec_decode
    assert spec is not None and spec.num_draft_tokens > 0
    (line,) = [entry for entry in logs if entry["event"] == "request"]
    assert line["spec_acceptance"] == round(spec.num_accepted_tokens / spec.num_draft_tokens, 4)
    text = await (await client.get("/metrics")).text()
    name = f'model_name="{MODEL_NAME}"'
    for metric, value in (("spec_decode_num_drafts", spec.num_drafts),
                          ("spec_decode_num_draft_tokens", spec.num_draft_tokens),
                          ("spec_decode_num_accepted_tokens", spec.num_accepted_tokens)):
        assert f"kvcore:{metric}_total{{{name}}} {float(value)}" in text, metric
    assert (f'kvcore:spec_decode_num_accepted_tokens_per_pos_total{{{name},position="0"}} '
            f"{float(spec.accepted_per_pos[0])}") in text

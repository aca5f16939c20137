"""TierConfig's checks, LLM(...)'s tier arguments, `kvcore plan`'s tier capacity (the page sizes
the tiers really use), async scheduling over the tiers and the cache events a router sees."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import run_all
from fake_device import fake_engine
from kvcore.cache import chain_hashes
from kvcore.cache.tiers import pagefile
from kvcore.cli import main
from kvcore.config_tiers import TierConfig
from kvcore.engine import Engine
from kvcore.engine.llm import LLM, engine_config
from kvcore.planner import PAGE_FILE_FIXED_BYTES
from kvcore.sampling import SamplingParams


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_offload_size": -1}, "kv_offload_size must be an integer >= 0"),
    ({"kv_offload_size": 1.5}, "kv_offload_size must be an integer >= 0"),
    ({"kv_tier_disk_size": True}, "kv_tier_disk_size must be an integer >= 0"),
    ({"kv_tier_dir": ""}, "kv_tier_dir must be a non-empty path"),
    ({"kv_tier_dir": "/x", "kv_tier_disk_size": 0}, "kv_tier_disk_size must be > 0"),
    ({"kv_offload_dtype": "int8"}, "kv_offload_dtype must be one of auto, int4, fp8"),
    ({"kv_tier_write_policy": "never"}, "kv_tier_write_policy must be one of"),
    ({"preemption_mode": "swap"}, "preemption_mode swap needs a tier"),
])
def test_bad_tier_configs_name_the_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TierConfig(**fields)


def test_tiers_are_off_by_default_and_swap_follows_them() -> None:
    assert not TierConfig().enabled and not TierConfig().swap
    assert TierConfig(kv_offload_size=1).swap
    assert not TierConfig(kv_offload_size=1, preemption_mode="recompute").swap


def test_llm_takes_the_tier_arguments(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = engine_config(str(tiny_model_dir), kv_offload_size="1MiB",
                           kv_tier_dir=str(tmp_path), kv_tier_write_policy="write_back")
    assert config.tiers == TierConfig(kv_offload_size=2**20, kv_tier_dir=str(tmp_path),
                                      kv_tier_write_policy="write_back")
    llm = LLM(str(tiny_model_dir), block_size=4, num_blocks=64, kv_offload_size="1MiB")
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 2
    llm.close()
    with pytest.raises(ValueError, match="need the prefix cache"):
        Engine(engine_config(str(tiny_model_dir), block_size=4, num_blocks=64,
                             enable_prefix_caching=False, kv_offload_size=2**20))


def test_plan_reports_each_tiers_capacity(capsys: pytest.CaptureFixture[str],
                                          tiny_model_dir: Path) -> None:
    assert main(["plan", "--model", str(tiny_model_dir), "--context", "64", "--block-size", "4",
                 "--kv-offload-size", "1MiB", "--kv-tier-disk-size", "1MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    host, disk = plan["tiers"]["host"], plan["tiers"]["disk"]
    page = plan["bytes_per_block"]  # tiny model: 2 layers x 2 heads x 16 x fp16, 4 tokens
    assert host["bytes_per_page"] == page == 2 * 2 * 2 * 16 * 2 * 4
    assert disk["bytes_per_page"] == page + pagefile.header_bytes(4)
    assert pagefile.header_bytes(4) - 8 * 4 == PAGE_FILE_FIXED_BYTES
    assert host["pages"] == 2**20 // page and host["tokens"] == host["pages"] * 4
    assert host["sequences"] == host["pages"] // 16  # 64 tokens = 16 blocks each
    assert main(["plan", "--model", str(tiny_model_dir), "--kv-offload-size", "1MiB",
                 "--kv-offload-dtype", "int4"]) == 0
    assert "host tier:" in capsys.readouterr().out


def test_async_scheduling_over_the_tiers_gives_the_same_tokens(tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """The fake device runs its work (tier copies included) in a worker thread, in stream
    order, while the host schedules the next step."""
    rng = np.random.default_rng(2)
    system = rng.integers(3, 259, 30).tolist()
    prompts = [system + rng.integers(3, 259, 10).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def outputs(on: bool, **tiers: Any) -> list[list[int]]:
        engine = fake_engine(tiny_model_dir, on, num_blocks=36, max_num_seqs=3, **tiers)
        # every prompt twice: its pages come back
        done = [out.outputs[0].token_ids for out in run_all(engine, prompts * 2, params)]
        if on and tiers:
            stats = engine.stats().tiers
            assert stats is not None and sum(stats.hit_tokens.values()) > 0
        engine.close()
        return done

    reference = outputs(False)
    assert outputs(True, kv_offload_size=1 << 20, kv_tier_dir=str(tmp_path)) == reference
    assert outputs(True, kv_offload_size=1 << 20, kv_tier_write_policy="write_back") == (
        reference)


def test_the_router_sees_the_pool_not_the_tiers(tiny_model_dir: Path) -> None:
    """Cache events name what the pool holds: an eviction into a tier is (False, h) and a
    page loaded back (True, h), so the prefix router keeps preferring the replica whose pool
    holds the blocks."""
    engine = Engine(engine_config(str(tiny_model_dir), block_size=4, num_blocks=24,
                                  max_num_seqs=1, kv_offload_size=1 << 20))
    engine.kv.pool.enable_events()
    prompt = list(range(10, 50))  # 10 blocks
    params = SamplingParams(temperature=0.0, max_tokens=2)
    hashes = chain_hashes(prompt, 4, None)
    engine.add_request("a", prompt, params)
    flood = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(2)]
    for i, other in enumerate(flood):
        engine.add_request(f"f{i}", other, params)
    while engine.has_unfinished_requests():
        engine.step()
    evicted = {h for cached, h in engine.kv.pool.drain_events() if not cached} & set(hashes)
    assert evicted  # gone from the pool (the host tier keeps them)
    engine.add_request("again", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().tiers.hit_tokens["host"] > 0  # type: ignore[union-attr]
    back = {h for cached, h in engine.kv.pool.drain_events() if cached}
    assert evicted <= back  # loaded back into the pool: the router may name it again
    engine.close()


def test_the_step_cost_fit_finds_the_per_token_cost() -> None:
    from kvcore.engine.tier_ops import PrefillCost

    cost = PrefillCost(weight=0.2)
    assert cost.per_token is None
    for tokens in (4, 4, 4):
        cost.observe(tokens, 0.010 + 0.002 * tokens)
    assert cost.per_token is None  # one step size: no slope to see yet
    for tokens in (4, 300, 16, 800, 4, 64):
        cost.observe(tokens, 0.010 + 0.002 * tokens)  # 10 ms a step + 2 ms a token
    assert cost.per_token == pytest.approx(0.002, rel=1e-6)

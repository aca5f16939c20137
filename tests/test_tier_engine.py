"""KV tiers in the engine (the tiny model): multi-turn sessions over a pool too small for them
give the same tokens with tiers off, host, disk and both, for every KV dtype; a restart finds
the disk's pages; a salt never restores another tenant's; swap preemption, failed loads, a full
disk and full write queues change speed, never outputs."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from engine_helpers import assert_pool_empty, make_engine, run_all
from kvcore.cache.kv_cache import CACHE_DTYPES
from kvcore.engine import Engine
from kvcore.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
RNG = np.random.default_rng(3)
SYSTEM = RNG.integers(3, 259, 36).tolist()  # shared by every session
USER = [[RNG.integers(3, 259, int(n)).tolist() for n in RNG.integers(6, 14, 4)]
        for _ in range(5)]  # 5 sessions x 4 turns


def sessions(engine: Engine, turns: range = range(4), salt: str | None = None,
             params: SamplingParams = GREEDY) -> list[list[int]]:
    """Every session's turns in rounds (a turn's prompt: the session so far + its new user
    tokens); the generated tokens of each turn, in order."""
    history = [list(SYSTEM) for _ in USER]
    for turn in range(turns.start):  # earlier turns as a client would replay them
        for s in range(len(USER)):
            history[s] += USER[s][turn] + [5 + turn] * 6
    outputs = []
    for turn in turns:
        done = run_all(engine, [history[s] + USER[s][turn] for s in range(len(USER))], params,
                       cache_salt=salt)
        outputs += [out.outputs[0].token_ids for out in done]
        for s in range(len(USER)):
            history[s] += USER[s][turn] + [5 + turn] * 6  # a fixed "assistant" reply
    return outputs


def small_engine(model: Path, **kwargs: Any) -> Engine:
    # 40 blocks of 4 tokens: about two sessions' contexts; max_num_seqs keeps it admissible
    kwargs.setdefault("num_blocks", 40)
    kwargs.setdefault("max_num_seqs", 2)
    return make_engine(model, **kwargs)


def restored(engine: Engine, tier: str) -> int:
    stats = engine.stats().tiers
    assert stats is not None
    return stats.hit_tokens.get(tier, 0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    out = {}
    for dtype in CACHE_DTYPES:
        engine = small_engine(tiny_model_dir, cache_dtype=dtype)
        out[dtype] = sessions(engine)
        out[dtype + "-seeded"] = sessions(engine, params=SEEDED)
    return out


@pytest.mark.parametrize("tiers", ["host", "disk", "both"])
def test_outputs_are_identical_with_tiers_off_and_on(tiny_model_dir: Path, tmp_path: Path,
                                                     reference: dict[str, Any],
                                                     tiers: str) -> None:
    args: dict[str, Any] = {}
    if tiers in ("host", "both"):
        args["kv_offload_size"] = 1 << 22
    if tiers in ("disk", "both"):
        args["kv_tier_dir"] = str(tmp_path)
    engine = small_engine(tiny_model_dir, **args)
    assert sessions(engine) == reference["fp16"]
    assert sessions(engine, params=SEEDED) == reference["fp16-seeded"]
    stats = engine.stats()
    assert stats.tiers is not None and sum(stats.tiers.hit_tokens.values()) > 0
    assert stats.tiers.load_failures == 0
    engine.close()
    assert_pool_empty(engine)


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_every_kv_dtype_restores_the_pools_bits(tiny_model_dir: Path, tmp_path: Path,
                                               reference: dict[str, Any], dtype: str) -> None:
    # int4: pages are sealed rows (an open block waits for its seal); fp8 / bf16: raw bits
    engine = small_engine(tiny_model_dir, cache_dtype=dtype, kv_offload_size=1 << 22,
                          kv_tier_dir=str(tmp_path))
    assert sessions(engine) == reference[dtype]
    assert sum(engine.stats().tiers.hit_tokens.values()) > 0  # type: ignore[union-attr]
    engine.close()


def test_a_restart_finds_the_sessions_on_disk(tiny_model_dir: Path, tmp_path: Path,
                                             reference: dict[str, Any]) -> None:
    first = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    before = sessions(first, range(2))
    first.close()  # queued writes land
    second = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    after = sessions(second, range(2, 4))
    assert before + after == reference["fp16"]
    assert restored(second, "disk") >= len(USER) * len(SYSTEM) // 4 * 4
    second.close()


def test_a_salt_never_restores_another_tenants_pages(tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    engine = small_engine(tiny_model_dir, kv_offload_size=1 << 22, kv_tier_dir=str(tmp_path))
    a = sessions(engine, range(1), salt="tenant-a")
    # the pool forgets tenant a's prefix; the tiers keep it
    run_all(engine, [RNG.integers(3, 259, 60).tolist() for _ in range(4)], GREEDY)
    restored_before = restored(engine, "host") + restored(engine, "disk")
    b = sessions(engine, range(1), salt="tenant-b")
    assert restored(engine, "host") + restored(engine, "disk") == restored_before
    assert sessions(engine, range(1), salt="tenant-a") == a == b
    assert restored(engine, "host") + restored(engine, "disk") > restored_before
    engine.close()
    fresh = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))  # on disk too
    assert sessions(fresh, range(1), salt="tenant-c") == a
    assert restored(fresh, "disk") == 0
    assert sessions(fresh, range(1), salt="tenant-a") == a
    assert restored(fresh, "disk") > 0
    fresh.close()


def test_swap_preemption_gives_the_recompute_outputs(tiny_model_dir: Path) -> None:
    prompts = [RNG.integers(3, 259, 30).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outputs, preemptions = {}, {}
    for mode in ("recompute", "swap"):
        tiers = {} if mode == "recompute" else {"kv_offload_size": 1 << 22,
                                                  "preemption_mode": "swap"}
        engine = make_engine(tiny_model_dir, num_blocks=40, **tiers)
        outputs[mode] = [out.outputs[0].token_ids for out in run_all(engine, prompts, params)]
        preemptions[mode] = engine.scheduler.num_preemptions
        if mode == "swap":
            assert restored(engine, "host") > 0  # swapped-out blocks came back
        engine.close()
        assert_pool_empty(engine)
    assert preemptions["recompute"] > 0 and preemptions["swap"] > 0
    assert outputs["swap"] == outputs["recompute"]


def test_failed_loads_degrade_to_recompute(tiny_model_dir: Path, tmp_path: Path,
                                          reference: dict[str, Any]) -> None:
    first = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    sessions(first, range(2))
    first.close()
    pages = sorted(tmp_path.rglob("*.kvpage"))
    assert pages
    for path in pages[::2]:  # every other page corrupt
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    second = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    assert sessions(second) == reference["fp16"]
    assert second.stats().tiers.load_failures > 0  # type: ignore[union-attr]
    assert second.tiers.store.tiers[0].num_removed_bad > 0  # type: ignore[union-attr]
    second.close()


def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(
        tiny_model_dir: Path, tmp_path: Path, reference: dict[str, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    engine = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("kvcore.cache.tiers.disk.os.replace", full)
    with structlog.testing.capture_logs() as logs:
        assert sessions(engine) == reference["fp16"]
        engine.close()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["kv tier disabled"]
    assert engine.tiers is not None and not engine.tiers.store.tiers[0].enabled


def test_full_write_queues_drop_pages_and_never_block(tiny_model_dir: Path,
                                                     reference: dict[str, Any]) -> None:
    engine = small_engine(tiny_model_dir, kv_offload_size=1 << 22)
    assert engine.tiers is not None
    for writer in engine.tiers.store._writers:
        writer.max_bytes = 0  # every queue full
    assert sessions(engine) == reference["fp16"]
    stats = engine.stats().tiers
    assert stats is not None and stats.dropped_writes["host"] > 0
    assert stats.stores == {} and stats.hit_tokens == {}
    engine.close()


def test_a_load_slower_than_recompute_is_not_started(tiny_model_dir: Path,
                                                    reference: dict[str, Any]) -> None:
    engine = small_engine(tiny_model_dir, kv_offload_size=1 << 22)
    assert engine.tiers is not None
    engine.tiers.store.counters.bandwidth["host"] = 1.0  # a byte per second
    assert sessions(engine) == reference["fp16"]
    assert engine.tiers.num_loads_skipped > 0 and restored(engine, "host") == 0
    assert engine.tiers.prefill_rate is not None  # measured from the steps
    engine.close()


def test_two_replicas_share_one_tier_directory(tiny_model_dir: Path, tmp_path: Path,
                                              reference: dict[str, Any]) -> None:
    a = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    b = small_engine(tiny_model_dir, kv_tier_dir=str(tmp_path))
    assert sessions(a, range(2)) == reference["fp16"][:2 * len(USER)]
    a.tiers.store.flush()  # type: ignore[union-attr]
    # b never saw these sessions: their prefixes come from the pages a wrote
    assert sessions(b, range(2, 4)) == reference["fp16"][2 * len(USER):]
    assert restored(b, "disk") > 0
    a.close()
    b.close()


def test_an_mla_models_shared_latent_pages_restore_too(tmp_path: Path) -> None:
    from tiny_deepseek import make_tiny_deepseek

    model = make_tiny_deepseek(tmp_path / "v2", "v2", seed=1, max_position_embeddings=512)
    reference = sessions(small_engine(model), range(2))
    engine = small_engine(model, kv_offload_size=1 << 22, kv_tier_dir=str(tmp_path / "t"))
    assert engine.tiers is not None and engine.tiers.copier.layout.shared_kv
    assert sessions(engine, range(2)) == reference
    assert sum(engine.stats().tiers.hit_tokens.values()) > 0  # type: ignore[union-attr]
    engine.close()

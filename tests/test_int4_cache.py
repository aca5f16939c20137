"""The int4 cache's arrays, window operations and bookkeeping, and the planner's int4 sizes:
exact bytes and slot ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcore import planner
from kvcore.cache import KVCacheManager, int4
from kvcore.cache.int4_window import ASSIGN, COPY, RELEASE, SEAL, STEP_SEAL, WindowSlots
from kvcore.cache.kv_cache import KVCache
from kvcore.kernels import cpu
from kvcore.kernels.cpu.kv_int4 import Int4Layer


def int4_cache(num_blocks: int = 6, num_slots: int = 3) -> KVCache:
    return KVCache(2, num_blocks, 4, 2, 16, "int4", num_window_slots=num_slots,
                   window_tokens=4)


def test_planner_int4_bytes_match_the_format() -> None:
    assert planner.INT4_GROUP == int4.DEFAULT_GROUP
    assert planner.canonical_dtype("int4") == "int4"
    per_block = planner.bytes_per_block(30, 3, 64, "int4", 16)
    assert per_block == 30 * (int4.key_row_bytes(16, 3, 64)
                              + int4.value_row_bytes(16, 3, 64, 32)) + 4
    assert planner.bytes_per_token(30, 3, 64, "int4", block_size=16) == -(-per_block // 16)
    result = planner.plan(30, 3, 64, "int4", 2048, memory=2**30, block_size=16, window_slots=100)
    window = planner.window_bytes(30, 3, 64, 100, 16)
    assert window == 2 * 30 * 100 * 16 * 3 * 64 * 2 == result.window_bytes
    assert result.num_blocks == (2**30 - window) // per_block
    # below fp8's bytes per token even with its scales (fp8: 2 x 30 x 3 x 64 = 11,520)
    assert result.bytes_per_token < planner.bytes_per_token(30, 3, 64, "fp8")
    with pytest.raises(ValueError, match="int4 does not hold a shared"):
        planner.bytes_per_block(30, 1, 576, "int4", 16, shared_kv=True)


def test_cache_bytes_match_the_planner() -> None:
    cache = int4_cache()
    # head_dim 16 < the default group 32: one group per head, in the cache and the planner
    assert cache.int4_group == 16
    expected = 6 * planner.bytes_per_block(2, 2, 16, "int4", 4) + planner.window_bytes(
        2, 2, 16, 3, 4)
    assert cache.num_bytes == expected
    k, v, k_scale, v_scale = cache.layer(1)
    assert isinstance(k, Int4Layer) and isinstance(v, Int4Layer) and k.window_slot is v.window_slot
    assert k.shape == (6, 4, 2, 16) and (k_scale, v_scale) == (1.0, 1.0)


def test_bad_int4_caches_are_refused() -> None:
    with pytest.raises(ValueError, match="num_window_slots must be >= 1"):
        KVCache(2, 6, 4, 2, 16, "int4")
    with pytest.raises(ValueError, match="shared"):
        KVCache(2, 6, 4, 1, 16, "int4", shared_kv=True, num_window_slots=2)
    with pytest.raises(ValueError, match="head_dim must be even"):
        KVCache(2, 6, 4, 1, 15, "int4", num_window_slots=2)


def test_window_ops_write_copy_seal_in_order() -> None:
    cache = int4_cache()
    rng = np.random.default_rng(0)
    cache.apply_window_ops([(ASSIGN, 5, 0), (ASSIGN, 2, 1)])
    tokens = rng.standard_normal((2, 4, 2, 16)).astype(np.float32)  # (layers, bs, Hkv, D)
    for layer_id in range(2):
        k, v, _, _ = cache.layer(layer_id)
        cpu.reshape_and_cache(tokens[layer_id], -tokens[layer_id], k, v, np.arange(20, 24))
    # seal block 5 (slot 0), then reuse slot 0 for block 1 as a copy of block 2's slot 1: the
    # seal reads the slot before the copy overwrites it
    cache.apply_window_ops([(SEAL, 5, 0), (ASSIGN, 1, 0), (COPY, 1, 0), (RELEASE, 2, 1)])
    assert cache.window_slot.tolist() == [-1, 0, -1, -1, -1, -1]
    for layer_id in range(2):
        window = tokens[layer_id].astype(np.float16)
        np.testing.assert_array_equal(cache.key_caches[layer_id][5],
                                      int4.quantize_key_block(window))
        np.testing.assert_array_equal(cache.value_caches[layer_id][5],
                                      int4.quantize_value_block(-window, 16))
        np.testing.assert_array_equal(cache.key_windows[layer_id][0],
                                      cache.key_windows[layer_id][1])


def test_window_slots_bookkeeping() -> None:
    window = WindowSlots(num_blocks=4, num_slots=3, block_size=4, window_tokens=4)
    window.open(3)
    window.open(0)
    assert window.num_free_slots == 1 and window.slot_of == [1, None, None, 0]
    window.copy(3, 0)
    window.drop_user(3, held=False, cached=True)  # into the prefix cache, rows stale: sealed
    window.drop_user(0, held=False, cached=False)  # dead: its slot given back
    window.give_back(0, keep_rows=True)  # already without a slot: nothing
    assert window.take_ops() == [(ASSIGN, 3, 0), (ASSIGN, 0, 1), (COPY, 0, 1), (SEAL, 3, 0),
                                 (RELEASE, 0, 1)]
    window.open(2)  # its writer is its fp16 user
    window.written(2)
    window.step_seal(2)  # read sealed by the step's later rows: sealed in the step
    window.step_seal(2)  # clean now: nothing
    assert window.take_ops() == [(ASSIGN, 2, 1), (STEP_SEAL, 2, 1)]
    window.drop_user(2, held=True, cached=False)  # its rows are valid: the slot just goes
    assert window.take_ops() == [(RELEASE, 2, 1)] and window.num_free_slots == 3


def test_gpu_windows_seal_before_the_step() -> None:
    """Where the kernels do not seal within a step (cuda), a block's rows are written when
    its slot goes back, before the next step."""
    window = WindowSlots(4, 2, 4, 4, seal_in_step=False)
    window.open(1)
    window.step_seal(1)
    assert window.take_ops() == [(ASSIGN, 1, 0)]
    window.drop_user(1, held=True, cached=False)
    assert window.take_ops() == [(SEAL, 1, 0)]


def test_a_pool_short_of_slots_allocates_nothing() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    window = WindowSlots(8, 2, 4, 4)  # window 4 tokens: one block per super-block
    kv.attach_window(window)
    kv.allocate_prefix("a", list(range(12)))
    assert kv.allocate_slots("a", list(range(12)), 12) is None  # 3 blocks, 2 slots
    assert kv.num_free_blocks == 8 and window.num_shortages == 1 and not window.take_ops()
    assert kv.allocate_slots("a", list(range(12)), 8) == []
    assert window.slot_of[:2] == [0, 1]
    # launched: its last row (7, block 1) reads block 0 sealed, sealed in the step; the next
    # row (8, block 2) reads neither in fp16: their slots go back before the next step
    assert window.take_ops() == [(ASSIGN, 0, 0), (ASSIGN, 1, 1), (STEP_SEAL, 0, 0)]
    assert window.take_ops() == [(RELEASE, 0, 0), (SEAL, 1, 1)]
    kv.free("a")
    assert window.take_ops() == [] and window.num_free_slots == 2


def test_slots_come_back_by_position() -> None:
    """A window of 8 tokens (2 blocks of 4): a step's rows past a super-block read its blocks
    sealed (sealed in the step), and their slots return once the next row is past it; no block
    is ever sealed early for want of a slot."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    window = WindowSlots(8, 3, 4, window_tokens=8)
    kv.attach_window(window)
    tokens = list(range(20))
    kv.allocate_prefix("a", tokens)
    assert kv.allocate_slots("a", tokens, 10) == []  # blocks 0-2, 2 tokens in block 2
    assert window.take_ops() == [(ASSIGN, 0, 0), (ASSIGN, 1, 1), (ASSIGN, 2, 2),
                                 (STEP_SEAL, 0, 0), (STEP_SEAL, 1, 1)]
    assert kv.allocate_slots("a", tokens, 6) == []  # block 3 takes a slot given back
    # launched: 16 tokens written, the next row (16) is past blocks 2 and 3 too
    assert window.take_ops() == [(RELEASE, 0, 0), (RELEASE, 1, 1), (ASSIGN, 3, 1)]
    assert window.take_ops() == [(SEAL, 2, 2), (SEAL, 3, 1)]
    assert window.num_shortages == 0 and window.num_free_slots == 3
    kv.allocate_prefix("b", tokens[:13])  # 3 cached blocks match: one whole super-block hits
    assert kv.block_table("b") == [0, 1]


def test_kvcore_plan_int4(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvcore plan --dtype int4`: the window pool as `kvcore serve` sizes it, set aside."""
    from kvcore.cli import main

    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--dtype",
                 "int4", "--memory", "1GiB", "--context", "2048", "--max-num-seqs", "8",
                 "--kv-int4-window", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    slots = 8 * 3 + 128  # 8 x (2 + 1) + 2,048 / 16: a super-block of 2 blocks
    assert out["window_slots"] == slots
    assert out["window_bytes"] == planner.window_bytes(30, 3, 64, slots, 16)
    per_block = planner.bytes_per_block(30, 3, 64, "int4", 16)
    assert out["bytes_per_block"] == per_block
    assert out["num_blocks"] == (2**30 - out["window_bytes"]) // per_block
    assert main(["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--dtype",
                 "int4", "--memory", "1GiB"]) == 0
    assert "fp16 window:" in capsys.readouterr().out

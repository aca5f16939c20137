"""Scheduler: token budget, chunked prefill, decode first, priorities, prefix hits, preemption."""

from __future__ import annotations

import pytest
import structlog

from kvcore.cache import chain_hashes
from kvcore.config import ParamError
from kvcore.engine.setup import check_capacity
from kvcore.request import SequenceStatus
from scheduler_helpers import (
    append,
    block_refcounts,
    counts,
    make_request,
    make_scheduler,
    run_step,
)


def test_chunked_prefill_then_decode() -> None:
    s = make_scheduler(budget=8)
    s.add(make_request("a", 20, max_tokens=3))
    chunks = [counts(run_step(s)) for _ in range(6)]
    assert chunks == [(("a", 8),), (("a", 8),), (("a", 4),), (("a", 1),), (("a", 1),), ()]
    assert not s.seqs
    assert s.kv.usage() == 0.0 and set(block_refcounts(s.kv)) == {0}


def test_decode_never_waits_behind_a_long_prompt() -> None:
    s = make_scheduler(budget=10)
    s.add(make_request("a", 3, max_tokens=50))
    run_step(s)  # a: prefill (3) and its first token
    s.add(make_request("b", 100, max_tokens=2))
    for _ in range(5):
        out = run_step(s)
        assert counts(out)[0] == ("a", 1)  # the decode first, the prompt gets what is left
        assert counts(out)[1] == ("b", 9)
        assert out.num_batched_tokens == 10


def test_running_prefill_first_then_waiting_fcfs_within_priority() -> None:
    s = make_scheduler(budget=4, max_num_seqs=8)
    s.add(make_request("low", 4, priority=1, max_tokens=1))
    s.add(make_request("hi1", 4, priority=0, max_tokens=1))
    s.add(make_request("hi2", 4, priority=0, max_tokens=1))
    order = [counts(run_step(s))[0][0] for _ in range(3)]
    assert order == ["hi1", "hi2", "low"]


def test_max_num_seqs_and_budget_are_never_exceeded() -> None:
    s = make_scheduler(budget=6, max_num_seqs=3)
    for i in range(5):
        s.add(make_request(f"r{i}", 2, max_tokens=3))
    while s.seqs:
        out = run_step(s)
        assert len(s.running) <= 3 and out.num_batched_tokens <= 6
    assert s.kv.usage() == 0.0


def test_prefix_hit_skips_computed_tokens_and_recomputes_the_last() -> None:
    s = make_scheduler(budget=64, block_size=4)
    prompt = list(range(1, 13))  # 12 tokens = 3 full blocks
    s.add(make_request("a", prompt, max_tokens=1))
    run_step(s)
    s.add(make_request("b", prompt, max_tokens=1))
    out = run_step(s)
    # blocks 0 and 1 hit; the third is full too but the last token is recomputed for its logits
    assert counts(out) == (("b", 4),)
    assert s.kv.num_prefix_hits == 8
    s.add(make_request("c", prompt, max_tokens=1, salt="tenant"))
    assert counts(run_step(s)) == (("c", 12),)  # another tenant's salt: no hit


def test_admission_control_rejects_what_can_never_run() -> None:
    # the engine refuses it before the scheduler sees it (Engine.check_request)
    with pytest.raises(ParamError, match="whole pool") as err:
        check_capacity(30, 3, 1, max_num_seqs=4, num_blocks=8, block_size=4)  # 33 tokens
    assert err.value.param == "max_tokens"
    with pytest.raises(ParamError, match="max_num_seqs=4") as err:
        check_capacity(3, 3, 5, max_num_seqs=4, num_blocks=8, block_size=4)
    assert err.value.param == "n"
    with pytest.raises(ParamError, match="whole pool") as err:  # 1 + 3 x (1 + 1) blocks
        check_capacity(3, 3, 3, max_num_seqs=4, num_blocks=6, block_size=4)
    assert err.value.param == "n"
    check_capacity(3, 3, 3, max_num_seqs=4, num_blocks=7, block_size=4)
    check_capacity(29, 3, 1, max_num_seqs=4, num_blocks=8, block_size=4)
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add(make_request("ok", 29, max_tokens=3))  # 32 tokens: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        s.add(make_request("ok", 3))
    assert list(s.seqs) == ["ok"]
    while s.seqs:
        run_step(s)
    assert s.kv.usage() == 0.0


def test_preemption_victim_is_lowest_priority_then_latest_and_goes_to_the_front() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, budget=64, max_num_seqs=2)
    s.add(make_request("old", 7, max_tokens=9))
    s.add(make_request("new", 7, max_tokens=9))
    s.add(make_request("later", 3, max_tokens=1))
    run_step(s)  # old and new take 2 blocks each; later waits for a seat
    assert [r.seq_id for r in s.running] == ["old", "new"]
    assert [r.seq_id for r in s.waiting] == ["later"]
    with structlog.testing.capture_logs() as logs:
        for _ in range(10):  # both grow a block every 4 tokens until 6 blocks run out
            out = run_step(s)
            if out.preempted_ids:
                break
    assert out.preempted_ids == ("new",)
    assert s.num_preemptions == 1
    assert [e["request_id"] for e in logs if e["event"] == "preempted"] == ["new"]
    new = s.seqs["new"]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert [r.seq_id for r in s.waiting] == ["new", "later"]  # the front: it came first
    while s.seqs:
        run_step(s)
    assert s.kv.usage() == 0.0 and set(block_refcounts(s.kv)) == {0}


def test_preempted_request_recomputes_to_the_same_tokens() -> None:
    def outputs(num_blocks: int) -> dict[str, list[int]]:
        s = make_scheduler(num_blocks=num_blocks, block_size=4, budget=32)
        requests = [make_request(f"r{i}", 5 + 3 * i, max_tokens=12) for i in range(4)]
        for request in requests:
            s.add(request)
        while s.seqs:
            run_step(s)
        assert s.kv.usage() == 0.0
        return {r.seq_id: r.output_token_ids for r in requests}, s.num_preemptions

    roomy, none = outputs(64)
    tight, some = outputs(8)
    assert none == 0 and some > 0
    assert tight == roomy


def test_priority_victim_over_arrival() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, budget=64)
    s.add(make_request("vip", 3, max_tokens=9, priority=0))
    s.add(make_request("bulk", 3, max_tokens=9, priority=5))
    s.seqs["bulk"].arrival_seq = 0  # even an older request goes first when less important
    preempted = []
    while s.seqs:
        preempted += run_step(s).preempted_ids
    assert preempted and set(preempted) == {"bulk"}


def test_finish_frees_blocks_at_once() -> None:
    s = make_scheduler(budget=4)
    a, b = make_request("a", 10, max_tokens=5), make_request("b", 2, max_tokens=5)
    s.add(a)
    s.add(b)
    run_step(s)  # a mid-prefill
    assert s.kv.usage() > 0
    s.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.status is SequenceStatus.FINISHED_ABORTED
    s.finish(b, SequenceStatus.FINISHED_ABORTED)  # still waiting: never held blocks
    assert s.kv.usage() == 0.0 and set(block_refcounts(s.kv)) == {0}
    assert not s.seqs and not s.schedule().scheduled


def test_eos_finishes_unless_ignored() -> None:
    s = make_scheduler()
    request = make_request("a", 3, max_tokens=10, ignore_eos=False)
    s.add(request)
    s.advance(s.schedule())
    append(s, "a", 7)
    assert request.status is SequenceStatus.RUNNING
    s.advance(s.schedule())
    append(s, "a", 0)  # EOS
    assert request.status is SequenceStatus.FINISHED_STOPPED and not s.seqs
    assert request.output_token_ids == [7, 0]
    assert s.kv.usage() == 0.0

    s.add(make_request("b", 3, max_tokens=2, ignore_eos=True))
    s.advance(s.schedule())
    append(s, "b", 0)
    assert s.seqs["b"].status is SequenceStatus.RUNNING
    s.advance(s.schedule())
    append(s, "b", 0)
    assert not s.seqs  # max_tokens: length


def test_preempted_victim_blocks_hashed_this_step_leave_the_prefix_cache() -> None:
    # regression: a decode scheduled earlier in the step hashed the block its token fills;
    # preempted later in the same step, that token is never computed, so the block (one slot
    # never written) must neither stay findable nor be evicted as a page (the KV tiers' hook)
    s = make_scheduler(num_blocks=4, block_size=4, budget=32)
    evicted: list[bytes] = []
    s.kv.pool.on_evict = lambda block, block_hash, token_bytes: evicted.append(block_hash)
    a = make_request("a", list(range(1, 7)), max_tokens=8, priority=1)
    s.add(a)
    run_step(s)  # a: 6 + 1 tokens
    c = make_request("c", list(range(20, 28)), max_tokens=8, priority=0)
    s.add(c)
    run_step(s)  # a: 8 tokens, c: 8 + 1 (2 blocks each): the pool is full
    dirty = chain_hashes(a.token_ids, 4, None)[1]  # a's 8th token (position 7) ends block 1
    out = s.schedule()  # a's decode hashes block 1; c's needs a block: a is the victim
    assert out.preempted_ids == ("a",)
    assert dirty not in s.kv.pool.cached and dirty not in evicted

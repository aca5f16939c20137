"""Speculative decoding's parts: the proposers' exact drafts, tenant isolation and memory bound
of the suffix index, config errors naming the field, draft slots in the KV cache (never hashed,
returned on rejection), the scheduler's budget and pool rules for drafts, and adaptation."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from kvcore.cache import KVCacheManager
from kvcore.cli import main
from kvcore.engine.llm import engine_config
from kvcore.model import BatchInput
from kvcore.request import Sequence, SequenceStatus
from kvcore.sampling import SamplingParams
from kvcore.speculation import SpeculativeConfig, SpeculativeConfigError, Speculator
from kvcore.speculation.adapt import StepCost
from kvcore.speculation.ngram import NgramProposer, continuation
from kvcore.speculation.suffix import SuffixProposer, TenantIndex
from scheduler_helpers import make_request, make_scheduler

BS = 4


def test_ngram_drafts_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # "6 7" occurred twice before; the latest continued with 9
    assert p.propose("a", tokens, None, 3) == [9, 2, 6]
    # the 3-gram "9 2 6" is longer than any other match: what followed it, then its period
    assert p.propose("a", [*tokens, 7, 9, 2, 6], None, 6) == [7, 7, 9, 2, 6, 7]
    assert p.propose("b", [1, 2, 3, 4], None, 3) == []  # no earlier occurrence
    assert NgramProposer(2, 2).propose("c", [3, 1, 3], None, 2) == []  # needs 2 tokens
    assert continuation([4, 5, 6], 1, 5) == [5, 6, 5, 6, 5]
    p.finish("a", None, None)
    assert "a" not in p._indexes


def test_suffix_drafts_from_the_tenant_only() -> None:
    p = SuffixProposer(low=1, high=4, max_tokens_per_tenant=100, max_tenants=4)
    p.finish("old", [10, 11, 12, 13, 14, 15], "tenant-a")
    # tenant a's output continues 10 11 12 with 13 14 15; the sequence's own tokens cannot
    assert p.propose("x", [3, 10, 11, 12], "tenant-a", 3) == [13, 14, 15]
    assert p.propose("y", [3, 10, 11, 12], "tenant-b", 3) == []  # never across tenants
    assert p.propose("z", [3, 10, 11, 12], None, 3) == []
    # a two-token context seen once is too weak to draft from; seen twice it drafts
    assert p.propose("v", [3, 4, 11, 12], "tenant-a", 3) == []
    p.finish("again", [7, 11, 12, 13], "tenant-a")
    assert p.propose("u", [3, 4, 11, 12], "tenant-a", 3) == [13, 14, 15]
    # its own tokens win when their match is longer
    assert p.propose("w", [11, 12, 99, 1, 11, 12, 99], "tenant-a", 2) == [1, 11]


def test_suffix_index_memory_is_bounded() -> None:
    index = TenantIndex(low=1, high=2, max_tokens=10)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 8, 9, 10])
    assert index.num_tokens == 10 and len(index.outputs) == 2
    index.add([11, 12, 13])  # the oldest output leaves, and its counts with it
    assert index.num_tokens == 7 and list(index.outputs) == [(7, 8, 9, 10), (11, 12, 13)]
    assert (1,) not in index.counts and (2, 3) not in index.counts
    assert index.counts[(8,)] == {9: 1} and index.counts[(7, 8)] == {9: 1}
    p = SuffixProposer(1, 2, 10, max_tenants=2)
    for tenant in ("a", "b", "c"):
        p.finish(tenant, [1, 2, 3], tenant)
    assert list(p.tenants) == ["b", "c"]  # the least recently used tenant was dropped
    p.finish("seq", None, "b")  # an incomplete output is not indexed
    assert p.tenants["b"].num_tokens == 3


def test_config_errors_name_the_field() -> None:
    cases = {
        '{"method": "eagle"}': "speculative_config.method",
        '{"num_speculative_tokens": 0}': "speculative_config.num_speculative_tokens",
        '{"prompt_lookup_min": 5, "prompt_lookup_max": 3}': "speculative_config.prompt_lookup_min",
        '{"prompt_lookup_max": "4"}': "speculative_config.prompt_lookup_max",
        '{"draft_model": "x"}': "speculative_config.draft_model",
        '[1]': "speculative_config",
        '{"method": ': "speculative_config",
    }
    for text, param in cases.items():
        with pytest.raises(SpeculativeConfigError) as err:
            SpeculativeConfig.parse(text)
        assert err.value.param == param, text
        assert param in str(err.value)
    config = SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_min": 6}')
    assert config == SpeculativeConfig(prompt_lookup_min=6, prompt_lookup_max=6)
    assert SpeculativeConfig.parse({"prompt_lookup_max": 1}) == SpeculativeConfig(
        prompt_lookup_max=1, prompt_lookup_min=1)
    assert engine_config("m", speculative_config='{"method": "suffix"}').speculative == (
        SpeculativeConfig(method="suffix"))
    assert engine_config("m").speculative is None


def test_draft_slots_are_never_hashed_and_go_back_on_rejection() -> None:
    m = KVCacheManager(8, BS)
    tokens = list(range(100, 106))  # 6 tokens: blocks 0 (full) and 1
    m.allocate_prefix("a", tokens)
    assert m.allocate_slots("a", tokens, 6) == []
    tokens.append(7)  # sampled: 7 tokens, 6 computed; verify it with 5 drafts
    assert m.allocate_slots("a", tokens, 1, 5) == []
    assert m.block_table("a") == [0, 1, 2] and m.num_tokens("a") == 12
    hashed = [b.block_id for b in m.pool.blocks if b.block_hash is not None]
    assert hashed == [0]  # block 1 holds draft tokens from position 7 on
    tokens += [8, 9]  # two drafts accepted (positions 7, 8): 9 tokens, the last not computed
    m.truncate("a", 8)
    m.cache_blocks("a", tokens)
    assert m.block_table("a") == [0, 1] and m.num_tokens("a") == 8
    assert [b.block_id for b in m.pool.blocks if b.block_hash is not None] == [0, 1]
    assert m.num_free_blocks == 6 and m.pool.blocks[2].ref_count == 0
    with pytest.raises(ValueError, match="num_tokens must be in"):
        m.truncate("a", 9)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        m.allocate_slots("a", tokens, 0, 2)  # drafts must follow every token
    m.free("a")
    assert m.num_free_blocks == 8


def test_scheduler_cuts_drafts_to_the_budget() -> None:
    s = make_scheduler(budget=4)
    s.add(make_request("a", 7, max_tokens=20))
    s.advance(s.schedule())  # its prompt: 7 tokens in blocks 0, 1, in two chunks
    s.advance(s.schedule())
    s.seqs["a"].append_token(9)
    out = s.schedule(drafts={"a": [1, 2, 3, 4, 5]})
    (item,) = out.scheduled
    assert item.num_draft_tokens == 3 and item.token_ids == [9, 1, 2, 3]  # budget 4
    assert out.num_batched_tokens == 4 and s.kv.block_table("a") == [0, 1, 2]
    s.advance(out)
    assert s.seqs["a"].num_computed_tokens == 8  # drafts count once accepted
    s.seqs["a"].append_token(1)  # one draft accepted, then the drawn token
    s.seqs["a"].append_token(6)
    s.settle_drafts(["a"])
    assert s.seqs["a"].num_computed_tokens == 9 and s.kv.num_tokens("a") == 9
    assert s.kv.block_table("a") == [0, 1, 2]


def test_drafts_never_cost_a_preemption() -> None:
    s = make_scheduler(num_blocks=5, budget=16)
    s.add(make_request("a", 7, max_tokens=8))
    s.add(make_request("b", 8, max_tokens=8))
    s.advance(s.schedule())  # a: blocks 0, 1; b: blocks 2, 3; block 4 free
    s.seqs["a"].append_token(9)
    s.seqs["b"].append_token(9)
    out = s.schedule(drafts={"a": [1, 2, 3]})  # a's drafts would take b's next block
    assert [(i.seq_id, i.num_draft_tokens) for i in out.scheduled] == [("a", 0), ("b", 0)]
    assert s.num_preemptions == 0 and s.kv.block_table("b") == [2, 3, 4]


def test_logits_rows_of_a_verifying_sequence() -> None:
    batch = BatchInput.build([[1, 2, 3], [4], [5, 6, 7, 8]], [0, 3, 2], [[0], [0], [0, 1]], 4,
                             [0, 1, 3])
    assert batch.logits_indices.tolist() == [3, 5, 6, 7]
    with pytest.raises(ValueError, match="sample must be in"):
        BatchInput.build([[1, 2]], [0], [[0]], 4, [3])
    plain = BatchInput.build([[1, 2], [3]], [0, 0], [[0], [1]], 4, [True, False])
    assert np.array_equal(plain.logits_indices, [1])


def _decoding(seq_id: str, tokens: list[int], **params: object) -> Sequence:
    seq = Sequence(seq_id=seq_id, request_id=seq_id, prompt_token_ids=tokens,
                   params=SamplingParams(max_tokens=50, **params),  # type: ignore[arg-type]
                   max_tokens=50)
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = len(tokens) - 1
    return seq


def _verify(spec: Speculator, seq: Sequence, drafts: dict[str, list[int]],
            accept_all: bool) -> None:
    """Accept the step's rows: every draft token accepted, or every one rejected at once."""
    rows = len(drafts["a"]) + 1
    drawn = [*drafts["a"], 0] if accept_all else [0] * rows
    list(spec.accept([seq] * rows, drawn, [None] * rows, drafts))


def test_adaptation_shrinks_drafts_and_backs_off_after_misses() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      clock=lambda: 0.0)
    seq = _decoding("a", [1, 2, 3, 1, 2, 3, 1, 2])
    assert spec.propose([_decoding("n", [1, 2, 1], n=2)]) == {}  # forks never draft
    lengths: list[int] = []
    for _ in range(30):
        drafts = spec.propose([seq])
        lengths.append(len(drafts.get("a", [])))
        if "a" in drafts:
            _verify(spec, seq, drafts, accept_all=False)
    # acceptance estimate 2/3 against the default threshold 0.25: 3 tokens (2/3, 4/9, 8/27
    # are above it, 16/81 is not); rejected: 1/2, so 1 token; a second miss in a row: 8 steps
    # off, then a one-token probe; rejected: 16 steps off, another probe
    assert lengths == [3, 1, *[0] * 8, 1, *[0] * 16, 1, 0, 0]
    stats = spec.stats
    assert stats.num_drafts == 4 and stats.num_draft_tokens == 6
    assert stats.num_accepted_tokens == 0 and seq.num_draft_tokens == 6
    grow = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      clock=lambda: 0.0)
    lengths = []
    for _ in range(4):  # every draft accepted: estimate 5/6, then all 4 positions pay
        drafts = grow.propose([seq])
        lengths.append(len(drafts["a"]))
        _verify(grow, seq, drafts, accept_all=True)
    assert lengths == [3, 4, 4, 4]
    many = [_decoding(f"s{i}", [1, 2, 1]) for i in range(9)]  # above max_batch (8)
    assert spec.propose(many) == {}
    seq.status = SequenceStatus.FINISHED_STOPPED
    spec.propose([])
    assert "a" not in spec._states


def test_draft_rows_are_costed_from_step_times() -> None:
    cost = StepCost()
    assert cost.threshold(1) == 0.25 and cost.threshold(4) == 0.25  # before any step
    cost.observe(0.0, 1, 0, True)
    cost.observe(1.0, 1, 4, True)  # the step without drafts took 1 s
    assert cost.base == {1: 1.0} and cost.row_cost == {}
    cost.observe(2.2, 1, 0, True)  # 4 draft rows added 0.2 s: 0.05 a row
    assert cost.row_cost[1] == pytest.approx(0.2 * 0.05 + 0.8 * 0.25)
    cost.observe(3.0, 1, 0, False)  # a step that prefilled: not timed
    cost.observe(9.0, 1, 0, True)
    assert cost.base == {1: pytest.approx(0.2 * 0.8 + 0.8 * 1.0)}
    cost.observe(20.0, 1, 4, True)  # 11 s: the engine idled in between, not timed
    cost.observe(25.0, 1, 0, True)  # 4 draft rows in 5 s: more than a step each, not timed
    assert cost.base == {1: pytest.approx(0.96)}
    assert cost.row_cost == {1: pytest.approx(0.21)}
    cost.observe(26.0, 1, 0, True)  # 1 s: counts
    assert cost.base == {1: pytest.approx(0.2 * 1.0 + 0.8 * 0.96)}
    cost.observe(27.0, 2, 2, True)  # no base for 2 sequences yet: nothing learnt
    cost.observe(28.0, 2, 0, True)
    assert 2 not in cost.row_cost
    cost.row_cost[3] = 0.9  # a stalled machine: capped, speculation stays possible
    assert cost.threshold(3) == 0.5
    cheap = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                       clock=lambda: 0.0)
    cheap.cost.row_cost[1] = 0.05  # rows cheap: all of 2/3, 4/9, 8/27, 16/81 pay
    assert cheap.propose([_decoding("a", [1, 2, 3, 1, 2, 3, 1, 2])]) == {"a": [3, 1, 2, 3]}
    dear = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1),
                      clock=lambda: 0.0)
    dear.cost.row_cost[1] = 0.45  # only the first position pays
    assert dear.propose([_decoding("a", [1, 2, 3, 1, 2, 3, 1, 2])]) == {"a": [3]}


def test_generate_flag_gives_the_same_text(tiny_model_dir: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", str(tiny_model_dir), "abcabcabcabc", "--max-tokens", "16",
            "--temperature", "0.7", "--seed", "3"]
    assert main(base) == 0
    off = capsys.readouterr().out
    assert main([*base, "--speculative-config", '{"method": "ngram", "prompt_lookup_min": 1}']
                ) == 0
    assert capsys.readouterr().out == off
    assert main([*base, "--speculative-config", '{"method": "medusa"}']) == 2
    err = capsys.readouterr().err
    assert "speculative_config.method" in err and err.count("\n") == 1


def test_serve_config_takes_the_flag() -> None:
    from kvcore.cli.serve import _config, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "suffix"}'])
    assert _config(args, "m").speculative == SpeculativeConfig(method="suffix")
    assert _config(parser.parse_args([]), "m").speculative is None

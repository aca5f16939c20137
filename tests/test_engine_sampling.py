"""Engine sampling on the tiny model: seeds, n > 1 over shared blocks, stop strings, logprobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine_helpers import assert_pool_empty, make_engine, random_prompts, run_all
from kvcore.model import BatchInput
from kvcore.sampling import SamplingParams, SamplingRow, XpSampler


def test_seeded_sampling_is_batch_independent(tiny_model_dir: Path) -> None:
    target = random_prompts(seed=5, num=1, low=12, high=13)[0]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234,
                            ignore_eos=True)
    alone = run_all(make_engine(tiny_model_dir), [target], params)[0].outputs[0].token_ids
    others = random_prompts(seed=6, num=20)
    mixed = [SamplingParams(max_tokens=9, temperature=1.0, top_k=20) for _ in others]
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    outs = run_all(engine, [*others[:10], target, *others[10:]], [*mixed[:10], params,
                                                                  *mixed[10:]])
    assert outs[10].outputs[0].token_ids == alone
    again = run_all(engine, [target], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                     seed=1235, ignore_eos=True))
    assert again[0].outputs[0].token_ids != alone  # another seed, another sample
    assert_pool_empty(engine)


def test_n_choices_equal_single_requests_seeded_seed_plus_index(tiny_model_dir: Path) -> None:
    prompt = random_prompts(seed=7, num=1, low=13, high=14)[0]
    engine = make_engine(tiny_model_dir)
    out = run_all(engine, [prompt], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=42,
                                                   ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, choice in enumerate(out.outputs):
        single = run_all(engine, [prompt], SamplingParams(max_tokens=10, temperature=1.0,
                                                          seed=42 + i, ignore_eos=True))[0]
        assert choice.token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert_pool_empty(engine)


def test_n_choices_share_the_prompt_blocks(tiny_model_dir: Path) -> None:
    prompt = random_prompts(seed=8, num=1, low=14, high=15)[0]  # 14 tokens: 3 full blocks + 2
    engine = make_engine(tiny_model_dir, enable_prefix_caching=False)
    engine.add_request("n4", prompt, SamplingParams(n=4, max_tokens=2, temperature=1.0,
                                                    ignore_eos=True))
    engine.step()  # one prefill, then three forks that share all 4 blocks
    members = [engine.scheduler.seqs[i] for i in ("n4", "n4#n1", "n4#n2", "n4#n3")]
    tables = [engine.kv.block_table(m.seq_id) for m in members]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 4
    assert [engine.kv.pool.blocks[b].ref_count for b in tables[0]] == [4, 4, 4, 4]
    assert engine.kv.num_blocks - engine.kv.num_free_blocks == 4
    out = engine.scheduler.schedule()
    # the shared, partially filled last block is copied for 3 of the 4 writers (copy on write)
    assert len(out.copy_ops) == 3 and {src for src, _ in out.copy_ops} == {tables[0][-1]}
    assert engine.kv.num_blocks - engine.kv.num_free_blocks == 7  # vs 16 for 4 separate requests
    engine.abort_request("n4")
    assert_pool_empty(engine)


def test_n_choices_under_preemption_match_a_roomy_pool(tiny_model_dir: Path) -> None:
    prompts = random_prompts(seed=9, num=6, low=10, high=20)
    params = SamplingParams(n=3, max_tokens=10, temperature=0.8, seed=3, ignore_eos=True)
    roomy = run_all(make_engine(tiny_model_dir), prompts, params)
    engine = make_engine(tiny_model_dir, num_blocks=40)
    tight = run_all(engine, prompts, params)
    assert engine.stats().num_preemptions > 0
    for a, b in zip(roomy, tight, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert_pool_empty(engine)


def test_stop_string_is_cut_and_never_streamed(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = "Once upon a time"
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    full = run_all(engine, [prompt], greedy)[0].outputs[0].text
    stop = full[10:13]
    assert stop and full.index(stop) == 10
    engine.add_request("s", prompt, SamplingParams(max_tokens=30, temperature=0.0,
                                                   ignore_eos=True, stop=[stop]))
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].text
            assert stop not in out.outputs[0].text
    choice = out.outputs[0]  # the final output: what changed (the finish)
    assert streamed == full[:10]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
    kept = run_all(engine, [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                                    stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[:13]
    assert_pool_empty(engine)


def test_stop_token_ids_and_eos(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(seed=10, num=1, low=8, high=9)[0]
    tokens = run_all(engine, [prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))[0].outputs[0].token_ids
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    out = run_all(engine, [prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                   stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)


def _independent_logits(model_dir: Path, prompt: list[int], output: list[int]) -> np.ndarray:
    """(len(output), V) logits before each output token, from one forward of the whole
    sequence in a fresh engine's cache (no engine step involved)."""
    seq = prompt + output[:-1]
    fresh = make_engine(model_dir, num_blocks=16)
    fresh.kv.allocate_prefix("x", seq)
    fresh.kv.allocate_slots("x", seq, len(seq))
    batch = BatchInput.build([seq], [0], [fresh.kv.block_table("x")], 4)
    batch = BatchInput(batch.input_ids, batch.positions, batch.slot_mapping,
                       batch.query_start_loc, batch.context_lens, batch.block_tables,
                       np.arange(len(prompt) - 1, len(seq), dtype=np.int64))
    return fresh.model.forward(batch, fresh.kv_cache)


def test_logprobs_match_the_model_distribution(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(seed=11, num=1, low=9, high=10)[0]
    out = run_all(engine, [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3,
                                                   ignore_eos=True))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 6
    # an independent forward over the whole sequence in a fresh cache, in float64
    logits = _independent_logits(tiny_model_dir, prompt, out.token_ids).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    for row, (token_id, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert lp.token_id == token_id == int(ref[row].argmax())
        assert lp.logprob == np.float64(ref[row, token_id]).round(12) or abs(
            lp.logprob - ref[row, token_id]) < 1e-4
        assert [t for t, _ in lp.top] == list(np.argsort(-ref[row])[:3])
    assert out.cumulative_logprob is not None
    assert abs(out.cumulative_logprob - sum(lp.logprob for lp in out.logprobs)) < 1e-9


def test_random_draws_are_the_xp_samplers_at_seed_and_output_position(tiny_model_dir: Path
                                                                      ) -> None:
    """The engine samples with the xp sampler: each token is the counter-based draw of (the
    sequence's seed, its output position) over that step's logits, recomputed here from one
    independent forward of the whole sequence."""
    engine = make_engine(tiny_model_dir)
    prompt = random_prompts(seed=12, num=1, low=9, high=10)[0]
    params = SamplingParams(max_tokens=8, temperature=1.3, seed=2026, ignore_eos=True)
    out = run_all(engine, [prompt], params)[0].outputs[0]
    logits = _independent_logits(tiny_model_dir, prompt, out.token_ids)  # (8, V)
    sampler = XpSampler(engine.eos_token_ids, logits.shape[1])
    rows = [SamplingRow(params, prompt, out.token_ids[:i], seed=2026) for i in range(8)]
    want = sampler(logits.copy(), sampler.batch(rows)).token_ids.tolist()
    assert out.token_ids == want
    # the position matters: the same logits row at another position draws other noise
    shifted = [SamplingRow(params, (), (), seed=2026, position=i + 1) for i in range(8)]
    assert sampler(logits.copy(), sampler.batch(shifted)).token_ids.tolist() != want
    assert len(set(want)) > 1

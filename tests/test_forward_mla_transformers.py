"""DeepSeek-V2 / V2-Lite / V3 (MLA + MoE) on tiny random checkpoints vs transformers' own
DeepseekV2ForCausalLM / DeepseekV3ForCausalLM: logits through the paged mixed-batch forward
(chunked prefill, shuffled blocks, both MLA forms), greedy generation through the engine under
preemption, and the routed experts of every token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import make_engine, random_prompts, run_all
from kvcore.model import DeepseekModel, load_model
from kvcore.model.moe import route
from kvcore.sampling import SamplingParams
from test_forward_transformers import _rel_err, paged_logits, reference_logits
from tiny_deepseek import make_tiny_deepseek

torch = pytest.importorskip("torch", reason="the reference extras (torch) are not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the reference extras (transformers) are not installed")

pytestmark = pytest.mark.reference

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2": ("v2", {}),
    "v2_lite": ("v2_lite", {}),
    "v3": ("v3", {}),
    "v3_rope_halves": ("v3", {"rope_interleave": False}),
    "v3_no_yarn": ("v3", {"rope_scaling": None}),
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def hf_model(model_dir: Path) -> Any:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # every tensor of the checkpoint landed in the reference (none left at random init)
    assert not any(info.values()), info
    return model


@pytest.mark.parametrize("mode", ["auto", "absorbed", "decompressed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str, mode: str) -> None:
    kind, overrides = CASES[case]
    model_dir = make_tiny_deepseek(tmp_path / case, kind, seed=len(case), **overrides)
    model = load_model(model_dir)
    assert isinstance(model, DeepseekModel)
    model.mla_mode = mode
    rng = np.random.default_rng(len(case))
    sequences = [[int(t) for t in rng.integers(0, 259, 40)] for _ in range(2)]
    ours = paged_logits(model, sequences, prefill=31)
    hf_model(model_dir)  # the checkpoint loads completely into transformers
    for seq, logits in zip(sequences, ours, strict=True):
        expected = reference_logits(model_dir, seq)
        assert logits.shape == expected.shape
        assert _rel_err(logits, expected) < 1e-4, (case, mode)


@pytest.mark.parametrize("change", [{"rope_scaling": None}, {"rope_interleave": False},
                                    {"routed_scaling_factor": 1.0}])
def test_the_feature_under_test_changes_the_logits(tmp_path: Path,
                                                   change: dict[str, Any]) -> None:
    """yarn, the rope layout and the routed scale matter on these prompts."""
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 259, 40)]
    a = paged_logits(load_model(make_tiny_deepseek(tmp_path / "a", "v3", seed=1)), [seq], 40)[0]
    b = paged_logits(load_model(make_tiny_deepseek(tmp_path / "b", "v3", seed=1, **change)),
                     [seq], 40)[0]
    assert _rel_err(a[-8:], b[-8:]) > 1e-2


@pytest.mark.parametrize("kind", ["v2", "v2_lite", "v3"])
def test_routed_experts_equal_transformers(tmp_path: Path, kind: str) -> None:
    model_dir = make_tiny_deepseek(tmp_path / kind, kind, seed=3)
    ours = load_model(model_dir)
    reference = hf_model(model_dir)
    moe = ours.config.moe
    assert moe is not None
    x = np.random.default_rng(4).standard_normal((64, 64)).astype(np.float32)
    for layer_id in range(moe.first_k_dense_replace, ours.config.num_layers):
        layer = ours.layers[layer_id].moe
        experts, weights = route(x, layer.gate, layer.score_bias, moe)
        with torch.no_grad():
            _, hf_weights, hf_experts = reference.model.layers[layer_id].mlp.gate(
                torch.from_numpy(x))
        order, hf_order = np.argsort(experts, axis=1), np.argsort(hf_experts.numpy(), axis=1)
        assert np.array_equal(np.take_along_axis(experts, order, 1),
                              np.take_along_axis(hf_experts.numpy(), hf_order, 1))
        np.testing.assert_allclose(np.take_along_axis(weights, order, 1),
                                   np.take_along_axis(hf_weights.numpy(), hf_order, 1),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_greedy_generation_equals_transformers_under_preemption(tmp_path: Path,
                                                                kind: str) -> None:
    model_dir = make_tiny_deepseek(tmp_path / kind, kind, seed=5)
    base = random_prompts(seed=6, num=1, low=9, high=10)[0]
    # a shared prefix (prefix-cache hits) and a pool far smaller than the demand (preemption)
    prompts = [base + tail for tail in random_prompts(seed=7, num=6, low=2, high=12)]
    engine = make_engine(model_dir, num_blocks=12)
    outputs = run_all(engine, prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    reference = hf_model(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=GREEDY.max_tokens, min_new_tokens=8,
                                          attention_mask=torch.ones(1, len(prompt),
                                                                    dtype=torch.long))
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_a_checkpoint_saved_by_transformers_loads(tmp_path: Path) -> None:
    """transformers' own config.json (rope_parameters, qk_head_dim, head_dim = rope dim) and
    tensor layout load into kvcore with the same logits."""
    source = make_tiny_deepseek(tmp_path / "ours", "v3", seed=8)
    hf_model(source).save_pretrained(tmp_path / "saved")
    seq = [int(t) for t in np.random.default_rng(9).integers(0, 259, 20)]
    a = paged_logits(load_model(source), [seq], prefill=12)[0]
    b = paged_logits(load_model(tmp_path / "saved"), [seq], prefill=12)[0]
    np.testing.assert_array_equal(a, b)


def test_a_mixed_step_runs_both_forms(tmp_path: Path) -> None:
    """A long prefill chunk (decompressed under auto) beside a decode token (absorbed) in one
    step gives the logits of the all-absorbed step."""
    from kvcore.cache.kv_cache import KVCache
    from kvcore.model import BatchInput
    from kvcore.model.mla import plan_step

    model = load_model(make_tiny_deepseek(tmp_path, "v2_lite", seed=10))
    assert isinstance(model, DeepseekModel) and model.config.mla is not None
    rng = np.random.default_rng(11)
    a, b = rng.integers(0, 259, 40).tolist(), rng.integers(0, 259, 21).tolist()
    logits = {}
    for mode in ("auto", "absorbed"):
        model.mla_mode = mode
        cache = KVCache(3, 24, 4, 1, 40, shared_kv=True)
        tables = [list(range(0, 10)), list(range(10, 16))]
        model.forward(BatchInput.build([b[:20]], [0], [tables[1]], 4), cache)
        batch = BatchInput.build([a, b[20:]], [0, 20], tables, 4)
        step = plan_step(batch.positions, batch.slot_mapping, batch.block_tables,
                         batch.context_lens, batch.query_start_loc, model.config.mla, mode)
        assert step.decompressed.tolist() == ([True, False] if mode == "auto" else [False] * 2)
        logits[mode] = model.forward(batch, cache)
    assert _rel_err(logits["auto"], logits["absorbed"]) < 1e-5


def test_forked_sequences_share_the_latent_blocks(tmp_path: Path) -> None:
    """n = 2 greedy: the fork shares every latent block (copy-on-write on the shared K/V array)
    and both continuations equal the single one."""
    model_dir = make_tiny_deepseek(tmp_path, "v3", seed=12)
    prompt = random_prompts(seed=13, num=1, low=10, high=11)[0]
    single = run_all(make_engine(model_dir), [prompt], GREEDY)[0].outputs[0].token_ids
    both = SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
    forked = run_all(make_engine(model_dir), [prompt], both)[0].outputs
    assert [o.token_ids for o in forked] == [single, single]

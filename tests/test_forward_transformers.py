"""kvcore's paged forward vs transformers (fp32, eager attention) on the same tiny checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine_helpers import make_engine, random_prompts, run_all
from kvcore.cache.kv_cache import KVCache
from kvcore.model import BatchInput, LlamaModel, load_model
from kvcore.sampling import SamplingParams
from tiny_model import make_tiny_model

torch = pytest.importorskip("torch", reason="the reference extras (torch) are not installed")
transformers = pytest.importorskip("transformers",
                                   reason="the reference extras (transformers) are not installed")

pytestmark = pytest.mark.reference

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "mistral_window": ("mistral", {"sliding_window": 7}),
    "qwen2": ("qwen2", {"num_attention_heads": 6, "num_key_value_heads": 2}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0}),
    "linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}),
    # Qwen3: per-head q/k RMSNorm, an explicit head_dim (4 x 24 != hidden 64)
    "qwen3": ("qwen3", {"head_dim": 24}),
    "qwen3_yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16},
                             "max_position_embeddings": 64}),
}


def paged_logits(model: LlamaModel, sequences: list[list[int]], prefill: int,
                 block_size: int = 4, cache_dtype: str = "fp32") -> list[np.ndarray]:
    """Every position's logits: the first `prefill` tokens of each sequence in three chunks
    (both sequences in every step), then the rest one decode token per step."""
    c = model.config
    num_blocks = sum(-(-len(s) // block_size) for s in sequences) + 2
    kv_heads, kv_width, shared_kv = c.kv_layout
    cache = KVCache(c.num_layers, num_blocks, block_size, kv_heads, kv_width, cache_dtype,
                    shared_kv=shared_kv)
    free = list(np.random.default_rng(0).permutation(num_blocks))
    tables: list[list[int | None]] = [[] for _ in sequences]
    decode = list(range(prefill + 1, len(sequences[0]) + 1))
    cuts = [0, prefill // 3, prefill // 2 + 1, prefill, *decode]
    out: list[list[np.ndarray]] = [[] for _ in sequences]
    for start, end in zip(cuts, cuts[1:], strict=False):
        for table in tables:
            while len(table) * block_size < end:
                table.append(int(free.pop()))
        batch = BatchInput.build([s[start:end] for s in sequences], [start] * len(sequences),
                                 tables, block_size)
        rows = np.arange(batch.num_tokens, dtype=np.int64)
        batch = BatchInput(batch.input_ids, batch.positions, batch.slot_mapping,
                           batch.query_start_loc, batch.context_lens, batch.block_tables, rows)
        logits = model.forward(batch, cache)
        for s in range(len(sequences)):
            out[s].append(logits[batch.query_start_loc[s]:batch.query_start_loc[s + 1]])
    return [np.concatenate(o) for o in out]


def reference_logits(model_dir: Path, sequence: list[int]) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(torch.tensor([sequence])).logits[0].numpy()  # type: ignore[no-any-return]


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    model_dir = make_tiny_model(tmp_path / case, arch, seed=len(case), **overrides)
    rng = np.random.default_rng(len(case))
    sequences = [[int(t) for t in rng.integers(0, 259, 40)] for _ in range(2)]
    ours = paged_logits(load_model(model_dir), sequences, prefill=31)
    for seq, logits in zip(sequences, ours, strict=True):
        expected = reference_logits(model_dir, seq)
        assert logits.shape == expected.shape
        assert _rel_err(logits, expected) < 1e-4, case


@pytest.mark.parametrize("case", ["mistral_window", "llama3_rope", "linear_rope", "qwen3_yarn"])
def test_the_feature_under_test_changes_the_logits(tmp_path: Path, case: str) -> None:
    """The window / rope scaling matter on these prompts, so matching transformers checks them."""
    arch, overrides = CASES[case]
    with_feature = make_tiny_model(tmp_path / "a", arch, seed=1, **overrides)
    plain = {k: v for k, v in overrides.items() if k not in ("sliding_window", "rope_scaling")}
    without = make_tiny_model(tmp_path / "b", arch, seed=1, sliding_window=None, **plain)
    seq = [int(t) for t in np.random.default_rng(2).integers(0, 259, 40)]
    a = paged_logits(load_model(with_feature), [seq], prefill=40)[0]
    b = paged_logits(load_model(without), [seq], prefill=40)[0]
    assert _rel_err(a[-8:], b[-8:]) > 1e-2


def test_qwen3_greedy_generation_equals_transformers(tmp_path: Path) -> None:
    """Through the engine (batched, chunked prefill): the tokens of transformers' generate."""
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=4, head_dim=24)
    prompts = random_prompts(seed=5, num=4, low=5, high=30)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = run_all(make_engine(model_dir, max_num_batched_tokens=16), prompts, params)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt]), do_sample=False,
                                          max_new_tokens=8, min_new_tokens=8,
                                          attention_mask=torch.ones(1, len(prompt),
                                                                    dtype=torch.long))
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()

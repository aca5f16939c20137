"""Paged forward (mixed prefill chunks and decode tokens) == a dense causal float64 forward."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model import BatchInput, LlamaModel, load_model
from tiny_model import make_tiny_model

ROUNDS = int(os.environ.get("KVCORE_FORWARD_ROUNDS", "1"))


def dense_forward(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """Logits (n, vocab) of one whole sequence, float64, no cache: the textbook Llama."""
    c = ModelConfig.from_dir(model_dir)
    raw = load_file(str(model_dir / "model.safetensors"))
    w = {k: v.astype(np.float64) for k, v in raw.items()}
    n, hd = len(token_ids), c.head_dim

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + c.rms_norm_eps) * weight

    def rotate(x: np.ndarray) -> np.ndarray:  # (n, heads, hd): pairs (j, j + hd/2) as complex
        inv_freq = c.rope_theta ** (-np.arange(0, hd, 2) / hd)
        z = (x[..., :hd // 2] + 1j * x[..., hd // 2:]) * np.exp(
            1j * np.arange(n)[:, None, None] * inv_freq)
        return np.concatenate([z.real, z.imag], axis=-1)

    pos = np.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if c.sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - c.sliding_window
    h = w["model.embed_tokens.weight"][token_ids]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        proj = {}
        for name, heads in (("q", c.num_heads), ("k", c.num_kv_heads), ("v", c.num_kv_heads)):
            y = x @ w[p + f"self_attn.{name}_proj.weight"].T
            if c.attention_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(n, heads, hd)
        q, k, v = rotate(proj["q"]), rotate(proj["k"]), proj["v"]
        group = c.num_heads // c.num_kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
        h = h + attn @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return norm(h, w["model.norm.weight"]) @ head.T


def run_schedule(model: LlamaModel, rng: np.random.Generator, block_size: int,
                 num_seqs: int, cache_dtype: str = "fp32",
                 release_window: int | None = None
                 ) -> list[tuple[list[int], dict[int, np.ndarray]]]:
    """Feed random sequences through steps that mix prefill chunks (cut at random boundaries)
    with decode tokens; return each sequence's tokens and the logits obtained at positions."""
    c = model.config
    prompts = [list(rng.integers(0, c.vocab_size, int(rng.integers(1, 45))))
               for _ in range(num_seqs)]
    totals = [len(p) + int(rng.integers(0, 6)) for p in prompts]  # tokens after decoding
    num_blocks = sum(-(-t // block_size) for t in totals) + 4
    free = [int(b) for b in rng.permutation(num_blocks)]  # shuffled block ids
    cache = KVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, cache_dtype)
    tokens = [list(map(int, p)) for p in prompts]
    computed = [0] * num_seqs
    tables: list[list[int | None]] = [[] for _ in range(num_seqs)]
    logits: list[dict[int, np.ndarray]] = [{} for _ in range(num_seqs)]
    while any(computed[s] < totals[s] for s in range(num_seqs)):
        active = [s for s in range(num_seqs) if computed[s] < totals[s]]
        active = [s for s in active if rng.random() < 0.8] or active[:1]  # some sit a step out
        chunks, wanted = [], []
        for s in active:
            if computed[s] >= len(tokens[s]):  # decode: "sample" a random next token
                tokens[s].append(int(rng.integers(0, c.vocab_size)))
            end = min(len(tokens[s]), computed[s] + int(rng.integers(1, 20)))
            chunks.append(tokens[s][computed[s]:end])
            while len(tables[s]) * block_size < end:
                tables[s].append(free.pop())
            wanted.append(rng.random() < 0.7)
        batch = BatchInput.build(chunks, [computed[s] for s in active],
                                 [tables[s] for s in active], block_size, wanted)
        # also ask for some mid-chunk rows: the logits of every position are checkable
        extra = rng.choice(batch.num_tokens, size=min(3, batch.num_tokens), replace=False)
        indices = np.unique(np.concatenate([batch.logits_indices, extra]))
        batch = BatchInput(batch.input_ids, batch.positions, batch.slot_mapping,
                           batch.query_start_loc, batch.context_lens, batch.block_tables,
                           indices.astype(np.int64))
        out = model.forward(batch, cache)
        assert out.shape == (len(indices), c.vocab_size) and out.dtype == np.float32
        for row, values in zip(indices, out, strict=True):
            logits[active[int(np.searchsorted(batch.query_start_loc, row, "right")) - 1]][
                int(batch.positions[row])] = values
        for s, chunk in zip(active, chunks, strict=True):
            computed[s] += len(chunk)
            if release_window is not None:  # as the cache manager: drop blocks behind the window
                for b in range(max(0, computed[s] - release_window + 1) // block_size):
                    tables[s][b] = None
    return [(tokens[s], logits[s]) for s in range(num_seqs)]


def _check_against_dense(model_dir: Path, results, rtol: float) -> None:
    assert sum(len(logits) for _, logits in results) >= 2 * len(results)
    for tokens, logits in results:
        expected = dense_forward(model_dir, tokens)
        for position, values in logits.items():
            err = np.abs(values - expected[position]).max() / np.abs(expected[position]).max()
            assert err < rtol, f"position {position} of {len(tokens)}: relative error {err:.2e}"


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_paged_forward_matches_dense(tiny_model_dir: Path, block_size: int) -> None:
    model = load_model(tiny_model_dir)
    for r in range(ROUNDS):
        rng = np.random.default_rng(1000 * block_size + r)
        _check_against_dense(tiny_model_dir, run_schedule(model, rng, block_size, 6), 1e-4)


@pytest.mark.parametrize("window,block_size", [(1, 4), (5, 4), (7, 3), (16, 16)])
def test_sliding_window_matches_dense(tmp_path: Path, window: int, block_size: int) -> None:
    model_dir = make_tiny_model(tmp_path, "mistral", seed=window, sliding_window=window)
    model = load_model(model_dir)
    rng = np.random.default_rng(window)
    results = run_schedule(model, rng, block_size, 5, release_window=window)
    _check_against_dense(model_dir, results, 1e-4)


def test_qwen2_bias_and_tied_embeddings_match_dense(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "qwen2", seed=3, tie_word_embeddings=True,
                                num_attention_heads=6, num_key_value_heads=2)
    model = load_model(model_dir)
    _check_against_dense(model_dir, run_schedule(model, np.random.default_rng(3), 4, 4), 1e-4)


def test_mqa_matches_dense(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path, "llama", seed=4, num_key_value_heads=1)
    model = load_model(model_dir)
    _check_against_dense(model_dir, run_schedule(model, np.random.default_rng(4), 2, 4), 1e-4)


@pytest.mark.parametrize("cache_dtype,rtol", [("fp16", 1e-3), ("bf16", 1e-2), ("fp8", 0.06)])
def test_low_precision_cache_stays_close(tiny_model_dir: Path, cache_dtype: str,
                                         rtol: float) -> None:
    model = load_model(tiny_model_dir)
    results = run_schedule(model, np.random.default_rng(9), 4, 4, cache_dtype)
    _check_against_dense(tiny_model_dir, results, rtol)


def test_forward_rejects_a_mismatched_cache(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    batch = BatchInput.build([[5, 6]], [0], [[0]], 4)
    with pytest.raises(ValueError, match="KV heads"):
        model.forward(batch, KVCache(2, 4, 4, 1, 16))
    with pytest.raises(ValueError, match="input_ids"):
        model.forward(BatchInput.build([[5, 300]], [0], [[0]], 4), KVCache(2, 4, 4, 2, 16))


def test_batch_build_slots_and_indices() -> None:
    batch = BatchInput.build([[7, 8, 9], [4]], [5, 6], [[3, 1], [None, 0]], 4, [False, True])
    np.testing.assert_array_equal(batch.positions, [5, 6, 7, 6])
    np.testing.assert_array_equal(batch.slot_mapping, [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 0 * 4 + 2])
    np.testing.assert_array_equal(batch.query_start_loc, [0, 3, 4])
    np.testing.assert_array_equal(batch.context_lens, [8, 7])
    np.testing.assert_array_equal(batch.block_tables, [[3, 1], [-1, 0]])
    np.testing.assert_array_equal(batch.logits_indices, [3])
    with pytest.raises(ValueError, match="released or missing"):
        BatchInput.build([[1]], [1], [[None]], 4)
    with pytest.raises(ValueError, match="does not cover"):
        BatchInput.build([[1, 2]], [3], [[0]], 4)

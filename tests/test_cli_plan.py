"""`kvcore plan` end to end: the issue's numbers, model configs, one-line errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcore.cli import main

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB, GiB = 2**10, 2**20, 2**30


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one object on one line
    result: dict[str, Any] = json.loads(out)
    return result


def plan_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcore plan: error: ")
    return lines[0]


def write_config(directory: Path, **fields: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    return directory


LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
         "num_hidden_layers": 32, "num_attention_heads": 32, "vocab_size": 32000,
         "max_position_embeddings": 4096}


def test_issue_numbers_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    r = plan_json(capsys, "--layers", "32", "--kv-heads", "32", "--head-dim", "128",
                  "--context", "4096", "--memory", "64GiB")
    assert r["bytes_per_token"] == 524288
    assert r["bytes_per_sequence"] == 2 * GiB
    assert r["num_blocks"] == 8192
    assert r["max_concurrent_sequences"] == 32
    assert (r["num_layers"], r["num_kv_heads"], r["head_dim"]) == (32, 32, 128)
    assert (r["dtype"], r["context"], r["memory"], r["block_size"]) == ("fp16", 4096, 64 * GiB, 16)
    assert r["sliding_window"] is None and r["model"] is None

    r = plan_json(capsys, "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                  "--context", "32000")
    assert r["bytes_per_token"] == 320 * KiB
    assert r["bytes_per_sequence"] == 32000 * 320 * KiB
    assert r["num_blocks"] is None and r["max_concurrent_sequences"] is None

    r = plan_json(capsys, "--layers", "80", "--kv-heads", "64", "--head-dim", "128")
    assert r["bytes_per_token"] == 5 * MiB // 2
    assert r["context"] == 4096  # the default without --model


def test_fp8_halves_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ("--layers", "32", "--kv-heads", "32", "--head-dim", "128", "--memory", "64GiB")
    full = plan_json(capsys, *shape)
    half = plan_json(capsys, *shape, "--dtype", "fp8")
    assert half["bytes_per_token"] * 2 == full["bytes_per_token"]
    assert half["bytes_per_sequence"] * 2 == full["bytes_per_sequence"]
    assert half["num_blocks"] == 2 * full["num_blocks"]
    assert half["max_concurrent_sequences"] == 2 * full["max_concurrent_sequences"] == 64


def test_human_output_in_binary_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "32", "--kv-heads", "32", "--head-dim", "128",
                 "--memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "512 KiB (524,288 bytes)" in out
    assert "2 GiB at 4,096 tokens" in out
    assert "8,192" in out and "32 sequences of 4,096 tokens" in out
    assert main(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
                 "--context", "32000"]) == 0
    out = capsys.readouterr().out
    assert "320 KiB" in out and "9.77 GiB at 32,000 tokens" in out
    assert "max concurrent" not in out  # no budget, no concurrency


def test_sliding_window_flag(capsys: pytest.CaptureFixture[str]) -> None:
    r = plan_json(capsys, "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                  "--context", "32768", "--sliding-window", "4096", "--memory", "24GiB")
    assert r["tokens_per_sequence"] == 4112 and r["blocks_per_sequence"] == 257
    assert r["max_concurrent_sequences"] == 47


def test_model_dir_reads_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = write_config(tmp_path / "llama2", **LLAMA)
    r = plan_json(capsys, "--model", str(model), "--memory", "64GiB")
    assert r["bytes_per_token"] == 524288 and r["context"] == 4096  # max_position_embeddings
    assert r["max_concurrent_sequences"] == 32 and r["model"] == str(model)
    assert plan_json(capsys, "--model", str(model), "--context", "1024")["context"] == 1024


def test_model_sliding_window_and_qwen2_unused_window(capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    mistral = write_config(tmp_path / "mistral", **{
        **LLAMA, "architectures": ["MistralForCausalLM"], "num_key_value_heads": 8,
        "sliding_window": 4096, "max_position_embeddings": 32768})
    r = plan_json(capsys, "--model", str(mistral), "--memory", "24GiB")
    assert r["sliding_window"] == 4096 and r["tokens_per_sequence"] == 4112
    assert plan_json(capsys, "--model", str(mistral), "--sliding-window", "1024")[
        "tokens_per_sequence"] == 1024 + 16
    qwen = write_config(tmp_path / "qwen", **{
        **LLAMA, "architectures": ["Qwen2ForCausalLM"], "num_key_value_heads": 4,
        "sliding_window": 4096, "use_sliding_window": False, "max_position_embeddings": 32768})
    r = plan_json(capsys, "--model", str(qwen))
    assert r["sliding_window"] is None and r["tokens_per_sequence"] == 32768


def test_config_with_only_planner_fields(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    # an architecture kvcore cannot serve still plans from its KV fields
    neox = write_config(tmp_path / "neox", architectures=["GPTNeoXForCausalLM"],
                        num_hidden_layers=44, num_attention_heads=64, hidden_size=6144)
    r = plan_json(capsys, "--model", str(neox))
    assert r["bytes_per_token"] == 2 * 44 * 64 * 96 * 2 and r["context"] == 4096
    gemma = write_config(tmp_path / "gemma", architectures=["Gemma2ForCausalLM"],
                         num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=256, sliding_window=4096, max_position_embeddings=8192)
    r = plan_json(capsys, "--model", str(gemma))
    assert r["bytes_per_token"] == 2 * 26 * 4 * 256 * 2
    assert (r["context"], r["sliding_window"], r["tokens_per_sequence"]) == (8192, 4096, 4112)


def test_sample_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    # `make serve`'s planner fallback: a Llama-3-8B-like config passed as a file
    r = plan_json(capsys, "--model", str(ROOT / "examples" / "sample-config.json"),
                  "--memory", "24GiB")
    assert r["bytes_per_token"] == 128 * KiB and r["context"] == 8192
    assert r["bytes_per_sequence"] == GiB and r["max_concurrent_sequences"] == 24


@pytest.mark.parametrize(("argv", "needle"), [
    (["--layers", "0", "--kv-heads", "8", "--head-dim", "128"], "--layers must be a positive"),
    (["--layers", "-3", "--kv-heads", "8", "--head-dim", "128"], "got -3"),
    (["--layers", "32", "--kv-heads", "0", "--head-dim", "128"], "--kv-heads"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "-1"], "--head-dim"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--context", "0"], "--context"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--block-size", "0"],
     "--block-size"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--sliding-window", "-5"],
     "--sliding-window"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp4"], "'fp4'"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "lots"], "'lots'"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory=-1GiB"], "'-1GiB'"),
    (["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--memory", "0"], "--memory"),
    (["--layers", "32", "--kv-heads", "8"], "missing --head-dim"),
    ([], "--model"),
    (["--model", "/nonexistent/model"], "cannot read model config"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                          needle: str) -> None:
    assert needle in plan_error(capsys, *argv)


def test_bad_configs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert "cannot read model config" in plan_error(capsys, "--model", str(broken))
    (broken / "config.json").write_text("[1, 2]")
    assert "not a JSON object" in plan_error(capsys, "--model", str(broken))
    partial = write_config(tmp_path / "partial", num_attention_heads=8, hidden_size=512)
    assert "'num_hidden_layers'" in plan_error(capsys, "--model", str(partial))
    zero = write_config(tmp_path / "zero", **{**LLAMA, "architectures": ["Foo"],
                                              "num_hidden_layers": 0})
    assert "must be a positive integer, got 0" in plan_error(capsys, "--model", str(zero))
    both = write_config(tmp_path / "both", **LLAMA)
    assert "not both" in plan_error(capsys, "--model", str(both), "--layers", "2")


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--layers", "many", "--kv-heads", "8", "--head-dim", "128"])
    assert info.value.code == 2
    assert "invalid int value" in capsys.readouterr().err


def test_console_script() -> None:
    script = Path(sys.executable).parent / "kvcore"
    if not script.exists():
        pytest.skip(f"no kvcore console script beside {sys.executable}")
    ok = subprocess.run([str(script), "plan", "--layers", "32", "--kv-heads", "32",
                         "--head-dim", "128", "--memory", "64GiB", "--json"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and json.loads(ok.stdout)["max_concurrent_sequences"] == 32
    bad = subprocess.run([str(script), "plan", "--layers", "32", "--kv-heads", "32",
                          "--head-dim", "128", "--dtype", "int3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        "kvcore plan: error: --dtype must be one of fp32, fp16, bf16, fp8, int4, got 'int3'"]

"""The engine's device wiring: which model and cache dtype each device gets, the cuda errors, the
CLI's --device / --enforce-eager, and the engine over a graphed fp16 model (emulated kernels)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

import kvcore.device
import kvcore.engine.setup as setup
import kvcore.model.half_llama as half_llama
from kvcore.cli import main
from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.device import resolve_device
from kvcore.engine import Engine
from kvcore.engine.setup import engine_cache_dtype, load_engine_model
from kvcore.model import load_model
from kvcore.model.half_llama import HalfLlamaModel
from kvcore.model.llama import LlamaModel
from kvcore.sampling import SamplingParams


def config(model_dir: Path, device: str = "cuda", cache_dtype: str = "auto",
           **engine: bool) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device=device,
                        cache=CacheConfig(block_size=4, num_blocks=128, cache_dtype=cache_dtype),
                        scheduler=SchedulerConfig(max_num_seqs=100, max_model_len=200), **engine)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> list[tuple[str, str]]:
    """cuda "available"; the fp16 model loads onto the CPU and CUDA graphs use the stand-in
    capturer. Returns the (model_dir, device) of each load_model call on cuda."""
    from graph_helpers import StandInCapturer

    calls: list[tuple[str, str]] = []

    def load(model_dir: str, device: str = "cpu", weight_format: str = "none") -> LlamaModel:
        if device == "cuda":
            calls.append((model_dir, device))
        return load_model(model_dir, "cpu", weight_format, half=device == "cuda")

    monkeypatch.setattr(kvcore.device, "cuda_available", lambda: True)
    monkeypatch.setattr(setup, "load_model", load)
    monkeypatch.setattr(half_llama, "CudaGraphCapturer", StandInCapturer)
    return calls


def test_cache_dtype_follows_the_model() -> None:
    assert engine_cache_dtype("auto", half_model=False) == "fp16"
    assert engine_cache_dtype("auto", half_model=True) == "fp16"
    for dtype in ("fp32", "fp16", "bf16", "fp8"):
        assert engine_cache_dtype(dtype, half_model=False) == dtype
    assert engine_cache_dtype("fp8", half_model=True) == "fp8"
    assert engine_cache_dtype("fp16", half_model=True) == "fp16"
    with pytest.raises(ValueError, match="cache_dtype 'bf16' does not pair with the fp16 model"):
        engine_cache_dtype("bf16", half_model=True)


def test_cpu_path_is_unchanged(tiny_model_dir: Path, fake_gpu: list) -> None:
    model, cache_dtype = load_engine_model(config(tiny_model_dir, "cpu"), "cpu")
    assert type(model) is LlamaModel and cache_dtype == "fp16" and not fake_gpu


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_cuda_loads_the_half_model_with_graphs(tiny_model_dir: Path, fake_gpu: list,
                                               device: str) -> None:
    resolved = resolve_device(device)
    assert resolved == "cuda"
    model, cache_dtype = load_engine_model(config(tiny_model_dir, device), resolved)
    assert fake_gpu == [(str(tiny_model_dir), "cuda")]
    assert isinstance(model, HalfLlamaModel) and cache_dtype == "fp16"
    assert model.graphs is not None
    assert model.graphs.sizes == (1, 2, 4, 8, 16, 32, 64, 100)  # capped by max_num_seqs
    assert model.graphs.max_blocks == 50  # max_model_len 200 / block_size 4
    model, cache_dtype = load_engine_model(
        config(tiny_model_dir, device, "fp8", enforce_eager=True), resolved)
    assert isinstance(model, HalfLlamaModel) and model.graphs is None and cache_dtype == "fp8"


@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16"])
def test_cuda_refuses_a_cache_dtype_the_half_model_cannot_use(
        tiny_model_dir: Path, fake_gpu: list, cache_dtype: str) -> None:
    with pytest.raises(ValueError, match=f"cache_dtype '{cache_dtype}' does not pair"):
        Engine(config(tiny_model_dir, "cuda", cache_dtype))
    assert not fake_gpu  # raised before any weight was loaded (or cache allocated)


def test_cuda_without_a_gpu_is_a_runtime_error(tiny_model_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvcore.device, "cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="device 'cuda' requested but no CUDA device"):
        Engine(config(tiny_model_dir, "cuda"))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_device_cuda_without_a_gpu_is_one_line(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        command: str) -> None:
    monkeypatch.setattr(kvcore.device, "cuda_available", lambda: False)
    monkeypatch.setattr("kvcore.cli.serve.configure_logging", lambda: None)  # no global logging
    prompt = ["hi"] if command == "generate" else []
    assert main([command, str(tiny_model_dir), *prompt, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == (f"kvcore {command}: error: device 'cuda' requested but no CUDA device is "
                   "usable (install kvcore[cuda12])\n")


def test_cli_enforce_eager_reaches_the_engine(tiny_model_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcore.cli import build_parser
    from kvcore.cli.serve import _config

    args = build_parser().parse_args(["serve", str(tiny_model_dir), "--enforce-eager"])
    assert _config(args, str(tiny_model_dir)).enforce_eager
    args = build_parser().parse_args(["serve", str(tiny_model_dir)])
    assert not _config(args, str(tiny_model_dir)).enforce_eager
    seen: list[EngineConfig] = []
    monkeypatch.setattr("kvcore.engine.Engine.__init__",
                        lambda self, c, *a: seen.append(c) or (_ for _ in ()).throw(
                            ValueError("stop here")))
    assert main(["generate", str(tiny_model_dir), "hi", "--enforce-eager"]) == 2
    assert main(["generate", str(tiny_model_dir), "hi"]) == 2
    assert [c.enforce_eager for c in seen] == [True, False]


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulation harness needs g++")
def test_engine_over_a_graphed_half_model_equals_eager(tiny_model_dir: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy output of the engine with CUDA graphs (stand-in capturer, emulated kernels) equals
    the eager half model's, as requests join, finish and change the decode batch size."""
    pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
    from engine_helpers import random_prompts, run_all
    from graph_helpers import StandInCapturer, route_kernels_through_emulation

    route_kernels_through_emulation(monkeypatch)
    base = dataclasses.replace(config(tiny_model_dir, "cpu"),  # auto: fp16 for the half model
                               scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=64))
    prompts = random_prompts(3, 6, high=20)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (7, 3, 9, 5, 2, 6)]
    outputs = []
    for graphed in (False, True):
        model = load_model(tiny_model_dir, device="cpu", half=True)
        if graphed:
            graphs = model.enable_cuda_graphs(4, 64, 4, StandInCapturer())
        with capture_logs() as logs:
            engine = Engine(base, model=model)
        assert engine.cache_dtype == "fp16"
        pool = next(e for e in logs if e["event"] == "kv cache pool")
        assert pool["device"] == "cpu" and pool["cache_dtype"] == "fp16"
        outputs.append([o.outputs[0].token_ids for o in run_all(engine, prompts, params)])
    assert outputs[0] == outputs[1]
    assert [len(t) for t in outputs[1]] == [7, 3, 9, 5, 2, 6]
    assert graphs.num_replays >= 5 and len(graphs._captured) >= 2


def test_llm_engine_args_take_enforce_eager() -> None:
    from kvcore.engine.llm import engine_config

    assert engine_config("m", enforce_eager=True).enforce_eager is True
    assert engine_config("m").enforce_eager is False
    with pytest.raises(ValueError, match="enforce_eager must be a bool, got 'yes'"):
        engine_config("m", enforce_eager="yes")

"""The fp16 GPU model of DeepSeek-V2/V3 (HalfDeepseekModel: MLA through mla_attention.cu, MoE)
run with NumPy float16 standing in for CuPy and every kernel through the emulated CUDA kernels,
tracks the fp32 CPU model: a mixed batch of prefill chunks and decode rows over shuffled blocks,
then greedy decoding."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import kvcore.device
import kvcore.engine.setup as setup
from kvcore.config import CacheConfig, EngineConfig, SchedulerConfig
from kvcore.engine import Engine
from kvcore.engine.setup import load_engine_model
from kvcore.model import load_model
from kvcore.model.half_deepseek import HalfDeepseekModel
from kvcore.sampling import SamplingParams

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from engine_helpers import random_prompts, run_all  # noqa: E402
from graph_helpers import route_kernels_through_emulation  # noqa: E402
from tiny_deepseek import make_tiny_deepseek, mla_steps  # noqa: E402


@pytest.mark.parametrize("kind,cache_dtype", [("v2", "fp16"), ("v3", "fp8")])
def test_half_deepseek_through_emulated_kernels(tmp_path: Path, kind: str, cache_dtype: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # latent 32 + rope 16: the MLA kernel takes multiples of 16
    model_dir = make_tiny_deepseek(tmp_path / kind, kind, seed=4, kv_lora_rank=32,
                                   qk_rope_head_dim=16)
    want = mla_steps(load_model(model_dir), model_dir, "fp32")
    route_kernels_through_emulation(monkeypatch)
    model = load_model(model_dir, device="cpu", half=True)  # NumPy fp16 stands in for CuPy
    assert isinstance(model, HalfDeepseekModel) and model.mla_mode == "absorbed"
    assert model.layers[0].attn.w_uk.dtype == np.float16 and model.layers[0].attn.kv_b is None
    got = mla_steps(model, model_dir, cache_dtype)
    tol = 1e-2 if cache_dtype == "fp16" else 6e-2  # fp8 rounds each cached latent
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=tol * np.abs(w).max())
        assert np.array_equal(g.argmax(-1), w.argmax(-1))
    with pytest.raises(ValueError, match="kv_cache dtype must be one of"):
        mla_steps(model, model_dir, "fp32")
    with pytest.raises(ValueError, match="run eagerly"):
        model.enable_cuda_graphs(4, 64, 4)


def test_engine_on_cuda_serves_the_half_deepseek_model(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """device cuda (a stand-in GPU): the engine loads HalfDeepseekModel without CUDA graphs,
    and its greedy output, as requests join and finish, equals the fp32 CPU engine's."""
    model_dir = make_tiny_deepseek(tmp_path / "v2", "v2", seed=5, kv_lora_rank=32,
                                   qk_rope_head_dim=16)

    def config(device: str) -> EngineConfig:
        return EngineConfig(model=str(model_dir), device=device,
                            cache=CacheConfig(block_size=4, num_blocks=64),
                            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=64))

    prompts = random_prompts(4, 5, high=20)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (6, 3, 8, 2, 5)]
    want = [o.outputs[0].token_ids for o in run_all(Engine(config("cpu")), prompts, params)]
    route_kernels_through_emulation(monkeypatch)
    monkeypatch.setattr(kvcore.device, "cuda_available", lambda: True)
    monkeypatch.setattr(setup, "load_model",
                        lambda model_dir, device="cuda", weight_format="none":
                        load_model(model_dir, "cpu", weight_format, half=True))
    model, cache_dtype = load_engine_model(config("cuda"), "cuda")
    assert isinstance(model, HalfDeepseekModel) and model.graphs is None
    assert cache_dtype == "fp16"
    engine = Engine(config("cpu"), model=model)  # the cache on the model's (stand-in) device
    assert engine.cache_dtype == "fp16"
    got = [o.outputs[0].token_ids for o in run_all(engine, prompts, params)]
    assert got == want

"""On a GPU: the MLA kernel through CuPy at DeepSeek's latent shape (512 + 64) equals the float64
oracle, and a tiny random DeepSeek-V2-style model on cuda (fp16, HalfDeepseekModel) tracks the
fp32 CPU model's logits, and the engine's greedy tokens on cuda are the CPU's argmax up to fp16
rounding. Marked `gpu`; skipped without a usable CUDA device
(run by tools/gpu_check.sh)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kernel_problems import mla_f64, mla_problem
from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.device import cuda_available
from kvcore.engine import LLM
from kvcore.kernels.cpu import jit
from kvcore.model import BatchInput, load_model
from kvcore.sampling import SamplingParams
from tiny_deepseek import make_tiny_deepseek, mla_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def device(array: np.ndarray):  # noqa: ANN201 - a cupy array
    """Upload; fp8 travels as its raw bits (CuPy has no such dtype)."""
    import cupy

    return cupy.asarray(array.view(np.uint8) if array.dtype == FP8 else array)


CASES = [  # (H, context_lens, q_lens, dtypes): V2-Lite's 16 heads, 64, V2/V3's 128
    (16, [1, 17, 4097, 300], [1, 1, 1, 1], "f16"),
    (128, [700, 33, 1500], [1, 33, 1], "f16-fp8"),
    (128, [2100, 90], [1, 40], "f16"),
    (64, [4096, 65], [1, 1], "bf16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-{c[3]}")
def test_mla_kernel_at_deepseek_shape(case: tuple) -> None:
    from kvcore.kernels import cuda

    heads, ctx, q_lens, dtypes = case
    rng = np.random.default_rng()
    kv_scale = 0.05 if dtypes.endswith("fp8") else 1.0
    p = mla_problem(rng, ctx, q_lens, heads, 512, 64, 16, dtypes, kv_scale)
    got = cuda.mla_paged_attention(device(p["query"]), device(p["cache"]),
                                   device(p["block_tables"]), device(p["context_lens"]),
                                   device(p["query_start_loc"]), 512, p["scale"], kv_scale)
    tol = 2e-2 if dtypes == "bf16" else 3e-3
    np.testing.assert_allclose(got.get().astype(np.float32), mla_f64(p), rtol=tol, atol=tol)


def test_mla_key_tile_fits_the_device() -> None:
    """The launcher sizes the key tiles to the device's opt-in shared memory (64 keys on an
    H100 / H200 at 512 + 64, 32 on an A100 with a 16-bit cache) and the launch is accepted."""
    from kvcore.kernels import cuda
    from kvcore.kernels.cuda.mla import mla_key_tile, mla_smem_bytes

    opt_in = cuda.ops().backend.smem_opt_in
    keys = mla_key_tile(576, 2, opt_in)
    assert mla_smem_bytes(512, 64, 2, keys) <= opt_in
    assert keys == (64 if opt_in >= 227 * 1024 else 32)


def test_tiny_deepseek_gpu_tracks_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the CPU side on the NumPy attention: no numba compile on the GPU machine (gpu_check's
    # time), and the reference path at that
    monkeypatch.setattr(jit, "_enabled", False)
    model_dir = make_tiny_deepseek(tmp_path / "v2", "v2", seed=4, kv_lora_rank=32,
                                   qk_rope_head_dim=16)
    cpu_model = load_model(model_dir)
    want = mla_steps(cpu_model, model_dir, "fp32")
    got = mla_steps(load_model(model_dir, "cuda"), model_dir, "fp16", "cuda")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-2 * np.abs(w).max())
    # the engine on cuda: its greedy tokens, teacher-forced through the fp32 CPU model, are each
    # the CPU's argmax up to fp16 rounding (random tiny models have near-ties that fp16 may
    # break the other way, so exact equality of whole generations would be luck)
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (5, 30, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = LLM(str(model_dir), device="cuda", block_size=16, num_blocks=64).generate(
        prompts, params)
    config = ModelConfig.from_dir(model_dir)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 12
        seq = prompt + tokens
        batch = BatchInput.build([seq], [0], [list(range(-(-len(seq) // 16)))], 16)
        batch = dataclasses.replace(batch, logits_indices=np.arange(len(prompt) - 1,
                                                                    len(seq) - 1))
        cache = KVCache(config.num_layers, 8, 16, *config.kv_layout[:2], "fp32",
                        shared_kv=True)
        logits = cpu_model.forward(batch, cache)  # (12, vocab): before each generated token
        chosen = logits[np.arange(len(tokens)), tokens]
        assert np.all(chosen >= logits.max(axis=-1) - 2e-2 * np.abs(logits).max())

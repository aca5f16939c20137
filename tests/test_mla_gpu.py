"""On a GPU: the MLA kernel through CuPy at DeepSeek's latent shape (512 + 64) equals the float64
oracle, and a tiny random DeepSeek-V2-style model on cuda (fp16, HalfDeepseekModel) tracks the
fp32 CPU model's logits and greedy tokens. Marked `gpu`; skipped without a usable CUDA device
(run by tools/gpu_check.sh)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from kernel_problems import mla_f64, mla_problem
from kvcore.device import cuda_available
from kvcore.engine import LLM
from kvcore.model import load_model
from kvcore.model.half_llama import load_half_model
from kvcore.sampling import SamplingParams
from tiny_deepseek import make_tiny_deepseek, mla_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def device(array: np.ndarray):  # noqa: ANN201 - a cupy array
    """Upload; fp8 travels as its raw bits (CuPy has no such dtype)."""
    import cupy

    return cupy.asarray(array.view(np.uint8) if array.dtype == FP8 else array)


CASES = [  # (H, context_lens, q_lens, dtypes): V2-Lite's 16 heads, V2/V3's 128
    (16, [1, 17, 4097, 300], [1, 1, 1, 1], "f16"),
    (128, [700, 33, 1500], [1, 33, 1], "f16-fp8"),
    (128, [2100, 90], [1, 40], "f16"),
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
    np.testing.assert_allclose(got.get().astype(np.float32), mla_f64(p), rtol=3e-3, atol=3e-3)


def test_tiny_deepseek_gpu_tracks_cpu(tmp_path: Path) -> None:
    model_dir = make_tiny_deepseek(tmp_path / "v2", "v2", seed=4, kv_lora_rank=32,
                                   qk_rope_head_dim=16)
    want = mla_steps(load_model(model_dir), model_dir, "fp32")
    got = mla_steps(load_half_model(model_dir, "cuda"), model_dir, "fp16", "cuda")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-2 * np.abs(w).max())
    rng = np.random.default_rng()
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (5, 30, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {name: [o.outputs[0].token_ids for o in LLM(
        str(model_dir), device=name, block_size=16, num_blocks=64).generate(prompts, params)]
        for name in ("cuda", "cpu")}
    assert tokens["cuda"] == tokens["cpu"]

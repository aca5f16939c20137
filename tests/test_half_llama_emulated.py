"""The fp16 GPU model (HalfLlamaModel) through the emulated CUDA kernels tracks the fp32 path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvcore.model import load_model

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from graph_helpers import route_kernels_through_emulation  # noqa: E402
from kernel_problems import greedy  # noqa: E402


@pytest.mark.parametrize("cache_dtype", ["fp16", "fp8"])
def test_half_model_through_emulated_kernels(tiny_model_dir: Path, cache_dtype: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    want_tokens, want_logits = greedy(load_model(tiny_model_dir), tiny_model_dir, "fp32", 8)
    route_kernels_through_emulation(monkeypatch)
    model = load_model(tiny_model_dir, device="cpu", half=True)  # NumPy fp16 stands in for CuPy
    assert model.layers[0].qkv.dtype == np.float16 and model.embed.dtype == np.float16
    tokens, logits = greedy(model, tiny_model_dir, cache_dtype, 8)
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=3e-2 * np.abs(want_logits).max())
    assert tokens == want_tokens
    with pytest.raises(ValueError, match="kv_cache dtype must be one of"):
        greedy(model, tiny_model_dir, "fp32", 1)

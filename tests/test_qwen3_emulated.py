"""Qwen3's per-head q/k RMSNorm on the fp16 GPU model path (HalfLlamaModel through the emulated
CUDA kernels) tracks the fp32 CPU path."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from kvcore.model import load_model
from tiny_model import make_tiny_model

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from graph_helpers import route_kernels_through_emulation  # noqa: E402
from kernel_problems import greedy  # noqa: E402


def test_qwen3_half_model_through_emulated_kernels(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # head_dim 32 (4 x 32 != hidden 64): the CUDA kernels take powers of two
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=6, head_dim=32)
    want_tokens, want_logits = greedy(load_model(model_dir), model_dir, "fp32", 8)
    route_kernels_through_emulation(monkeypatch)
    model = load_model(model_dir, device="cpu", half=True)  # NumPy fp16 stands in for CuPy
    assert model.layers[0].q_norm is not None and model.layers[0].q_norm.dtype == np.float16
    tokens, logits = greedy(model, model_dir, "fp16", 8)
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=3e-2 * np.abs(want_logits).max())
    assert tokens == want_tokens


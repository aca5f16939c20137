"""The model's forward with every kernel routed through the emulated CUDA kernels (the GPU path's
wrappers and .cu sources, run on the CPU) gives the logits of the NumPy path.

This checks what no unit test of a single kernel does: that the wrappers accept exactly what
kvcore.model.llama passes them (strided q/k slices, metadata arrays, cache dtypes), in a mixed
batch of prefill chunks and decode steps.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvcore.kernels as kernels
from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.kernels.cuda.ops import CudaOps
from kvcore.model import BatchInput, load_model

pytest.importorskip("cupy", reason="cupy's CCCL headers provide <nv/target> for cuda_fp16.h")
if shutil.which("g++") is None:
    pytest.skip("the emulation harness needs g++", allow_module_level=True)

from cuda_emu import EmuBackend  # noqa: E402


def run_steps(model_dir: Path, cache_dtype: str) -> list[np.ndarray]:
    """Two sequences: a prompt in two chunks beside a shorter prompt, then decode steps."""
    c = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir)
    model.fused = None  # the per-op path: every op through kvcore.kernels' dispatch
    cache = KVCache(c.num_layers, 16, 4, c.num_kv_heads, c.head_dim, cache_dtype)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, c.vocab_size, size=n).tolist() for n in (11, 5)]
    tables = [[3, 9, 0, 12, 5], [7, 2, 14]]
    steps = [([seqs[0][:6], seqs[1]], [0, 0]), ([seqs[0][6:], [41]], [6, 5])]
    steps += [([[17 + i], [23 + i]], [11 + i, 6 + i]) for i in range(2)]
    logits = []
    for chunks, computed in steps:
        batch = BatchInput.build(chunks, computed, tables, 4)
        logits.append(model.forward(batch, cache))
    return logits


@pytest.mark.parametrize("cache_dtype", ["fp32", "fp8"])
def test_forward_through_emulated_cuda_kernels(tiny_model_dir: Path, cache_dtype: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    expected = run_steps(tiny_model_dir, cache_dtype)
    ops = CudaOps(EmuBackend())
    emulated = SimpleNamespace(**{name: getattr(ops, name) for name in (
        "reshape_and_cache", "copy_blocks", "rms_norm", "silu_and_mul", "rope")})
    # on a GPU the model's metadata are device arrays: grids sized from shapes, no read-back
    emulated.paged_attention = functools.partial(ops.paged_attention, host_metadata=False)
    calls: list[str] = []
    monkeypatch.setattr(kernels, "_on_gpu", lambda array: calls.append("gpu") or True)
    monkeypatch.setattr(kernels, "_cuda", lambda: emulated)
    got = run_steps(tiny_model_dir, cache_dtype)
    assert len(calls) > 20  # every kernel call went the GPU way
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)

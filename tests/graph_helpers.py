"""Helpers for CUDA graph tests on the CPU: the stand-in capturer and the emulated kernels."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvcore.kernels as kernels
from kvcore.kernels.cuda.ops import CudaOps


class ReplayGraph:
    def __init__(self, step: Callable[[], Any], out: np.ndarray) -> None:
        self.step, self.out = step, out

    def replay(self) -> None:
        np.copyto(self.out, self.step())  # a CUDA graph rewrites the very array it captured


class StandInCapturer:
    """The CPU stand-in for CudaGraphCapturer."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_uploads = 0
        self.num_steps_uploaded = 0

    def capture(self, step: Callable[[], Any]) -> tuple[ReplayGraph, Any]:
        self.num_captures += 1
        out = step()
        return ReplayGraph(step, out), out

    def upload(self, dst: np.ndarray, src: np.ndarray) -> None:
        assert dst.shape == src.shape and dst.dtype == src.dtype  # a plain copy, no reshaping
        np.copyto(dst, src)
        self.num_uploads += 1

    def end_uploads(self) -> None:
        self.num_steps_uploaded += 1


def route_kernels_through_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every kernel through the emulated CUDA kernels with device-side metadata."""
    from cuda_emu import EmuBackend

    ops = CudaOps(EmuBackend())
    impl = SimpleNamespace(**{name: getattr(ops, name) for name in (
        "reshape_and_cache", "copy_blocks", "rms_norm", "silu_and_mul", "rope")})
    impl.paged_attention = functools.partial(ops.paged_attention, host_metadata=False)
    impl.cache_latent = ops.cache_latent
    impl.mla_paged_attention = functools.partial(ops.mla_paged_attention, host_metadata=False)
    monkeypatch.setattr(kernels, "_on_gpu", lambda array: True)
    monkeypatch.setattr(kernels, "_cuda", lambda: impl)

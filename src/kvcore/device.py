"""The one place that chooses NumPy or CuPy (`xp`), moves arrays and synchronizes."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np


def cuda_available() -> bool:
    try:
        import cupy  # type: ignore[import-not-found]

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no cupy, no driver, or no device: all mean "no GPU here"
        return False


def resolve_device(device: str) -> str:
    """Map "auto" to "cuda" when a GPU is usable, else "cpu"; refuse "cuda" without one."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise RuntimeError(
            "device 'cuda' requested but no CUDA device is usable (install kvcore[cuda12])")
    return device


def get_xp(device: str) -> ModuleType:
    if device == "cuda":
        import cupy

        return cupy
    return np


def array_module(array: Any) -> ModuleType:
    """NumPy or CuPy, whichever owns `array`."""
    if type(array).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def to_numpy(array: Any) -> np.ndarray:
    if type(array).__module__.startswith("cupy"):
        return array.get()  # type: ignore[no-any-return]
    return np.asarray(array)


def to_device(array: np.ndarray, device: str) -> Any:
    return get_xp(device).asarray(array)


def synchronize(device: str) -> None:
    if device == "cuda":
        import cupy

        cupy.cuda.get_current_stream().synchronize()

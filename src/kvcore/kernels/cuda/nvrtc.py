"""Where the CUDA kernel sources live and the NVRTC options every compile of them uses (the
runtime's CuPy backend and the dev compile check alike)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent  # the .cu / .cuh sources


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h & co.: the CUDA wheels' include dirs, or a CUDA install."""
    candidates: list[Path] = []
    for entry in sys.path:
        root = Path(entry) / "nvidia"
        candidates += [root / "cuda_runtime" / "include", root / "cu13" / "include",
                       root / "cu12" / "include"]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    found: list[str] = []
    for path in candidates:
        if (path / "cuda_fp16.h").is_file() and str(path) not in found:
            found.append(str(path))
    return found


def nvrtc_options() -> tuple[str, ...]:
    """The options kvcore passes to cupy.RawModule (CuPy adds its own)."""
    return ("--std=c++17", f"-I{KERNEL_DIR}", *(f"-I{d}" for d in cuda_include_dirs()))

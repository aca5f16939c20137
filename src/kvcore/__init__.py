"""kvcore: a framework-free LLM inference runtime."""

import os
import sys

__version__ = "0.1.0"

# OpenBLAS's worker threads spin for 2^28 cycles (about 0.1 s) after each multi-threaded GEMM
# before they sleep. The CPU path alternates GEMMs with attention and element-wise work on its own
# threads (kvcore.kernels.cpu.threads), which then shared the cores with spinning BLAS workers.
# 2^18 cycles (~0.1 ms) still spans the short gaps between one layer's GEMMs but not the
# attention between them; measured on 2 cores against the default: a 256-sequence decode step
# 1.5x and a 2,048-token prefill 1.3x faster, batch-1 decode 1.1x faster than with 2^4. OpenBLAS
# reads the variable when it is loaded, so this takes effect only when kvcore is imported before
# NumPy; a value already set wins.
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "18")

# The public API, imported lazily: `import kvcore` stays light (and sets the BLAS variable above
# before anything imports NumPy); `from kvcore import LLM` loads the engine on first use.
_PUBLIC = {
    "LLM": "kvcore.engine",
    "AsyncEngine": "kvcore.engine",
    "RequestFailed": "kvcore.engine",
    "SamplingParams": "kvcore.sampling",
    "BeamSearchParams": "kvcore.sampling",
    "EngineConfig": "kvcore.config",
    "CacheConfig": "kvcore.config",
    "SchedulerConfig": "kvcore.config",
    "ParamError": "kvcore.config",
    "SpeculativeConfig": "kvcore.config_speculative",
    "RequestOutput": "kvcore.request",
    "CompletionOutput": "kvcore.request",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> object:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])

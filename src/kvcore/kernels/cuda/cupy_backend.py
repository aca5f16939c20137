"""The CUDA kernels' backend on a GPU: CuPy RawModules compiled with kvcore's NVRTC options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy  # type: ignore[import-not-found]
import numpy as np

from kvcore.kernels.cuda.launch import Kernel
from kvcore.kernels.cuda.nvrtc import KERNEL_DIR, nvrtc_options


class CupyBackend:
    """CudaOps' backend on a GPU: RawModule kernels, CuPy arrays."""

    xp = cupy

    def __init__(self) -> None:
        self._modules: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._functions: dict[tuple[str, str, tuple[str, ...]], Kernel] = {}
        self._num_sms: int | None = None

    @property
    def smem_opt_in(self) -> int:
        """The most shared memory a block of the current device may opt in to."""
        return int(cupy.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])

    @property
    def num_sms(self) -> int:
        """The current device's SM count, queried once."""
        if self._num_sms is None:
            self._num_sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
        return self._num_sms

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> Kernel:
        """Kernel `name` of `source` compiled with -D`defines` (one module per variant)."""
        kernel = self._functions.get((source, name, defines))
        if kernel is None:
            module = self._modules.get((source, defines))
            if module is None:
                code = (KERNEL_DIR / source).read_text()
                options = (*nvrtc_options(), *(f"-D{d}" for d in defines))
                module = cupy.RawModule(code=code, options=options)
                self._modules[source, defines] = module
            kernel = self._functions[source, name, defines] = module.get_function(name)
            # a kernel asking for more than 48 KB of dynamic shared memory must opt in: allow
            # what the device allows (227 KB on sm_90, 163 KB on sm_80), minus the static part
            kernel.max_dynamic_shared_size_bytes = self.smem_opt_in - kernel.shared_size_bytes
        return kernel

    def pointer_array(self, arrays: Sequence[Any]) -> Any:
        return cupy.asarray(np.array([a.data.ptr for a in arrays], dtype=np.int64))  # (L,)

    def to_host(self, array: Any) -> np.ndarray:
        return cupy.asnumpy(array)  # type: ignore[no-any-return]

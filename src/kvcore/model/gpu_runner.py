"""The half-precision GPU model: fp16 weights on the device, cuBLAS matmuls, our CUDA kernels.

`HalfLlamaModel` is LlamaModel with every weight stored as float16 (bf16 and fp32 checkpoints
are converted on load), so the residual stream, the matmuls (cupy.matmul, i.e. cuBLAS) and the
kernels (RMSNorm, RoPE, SwiGLU, paged attention) all run in fp16 with fp32 accumulation inside
the kernels. Its KV cache must be fp16 or fp8 (the kernels pair fp16 activations with those).
`Engine(config, model=load_half_model(dir))` serves it (with cache_dtype fp16 or fp8); the CPU
path keeps LlamaModel in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model.batch import BatchInput
from kvcore.model.llama import LlamaModel
from kvcore.model.weights import Checkpoint, iter_weights

HALF_CACHE_DTYPES = ("fp16", "fp8")


class HalfLlamaModel(LlamaModel):
    """LlamaModel whose weights live on the device as float16."""

    def _put(self, array: np.ndarray) -> Any:
        # one conversion on the host, one copy to the device; rope tables stay fp32 (not _put)
        return self.xp.asarray(np.ascontiguousarray(array, dtype=np.float16))

    def forward(self, batch: BatchInput, kv_cache: KVCache) -> np.ndarray:
        if kv_cache.dtype not in HALF_CACHE_DTYPES:
            raise ValueError(f"kv_cache dtype must be one of {HALF_CACHE_DTYPES} for fp16 "
                             f"activations, got {kv_cache.dtype!r}")
        return super().forward(batch, kv_cache)


def load_half_model(model_dir: str | Path, device: str = "cuda") -> HalfLlamaModel:
    """Read config.json and the safetensors weights into a HalfLlamaModel on `device`."""
    config = ModelConfig.from_dir(model_dir)
    checkpoint = Checkpoint(model_dir)
    try:
        weights = dict(iter_weights(checkpoint, config))  # float32 views of the memory map
        return HalfLlamaModel(config, weights, device)
    finally:
        checkpoint.close()

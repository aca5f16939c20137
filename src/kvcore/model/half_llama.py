"""The half-precision GPU model: fp16 weights on the device, cuBLAS matmuls, our CUDA kernels.

`HalfLlamaModel` is LlamaModel with every weight stored as float16 (bf16 and fp32 checkpoints
are converted on load), so the residual stream, the matmuls (cupy.matmul, i.e. cuBLAS) and the
kernels (RMSNorm, RoPE, SwiGLU, paged attention) all run in fp16 with fp32 accumulation inside
the kernels. Its KV cache must be fp16, fp8 or int4 (the kernels pair fp16 activations with those).
The engine loads it on cuda (`kvcore.engine.setup.load_engine_model`, cache_dtype auto = fp16)
and turns on CUDA graphs for pure-decode steps (`enable_cuda_graphs`, kvcore/model/cuda_graph.py)
unless enforce_eager; every other step runs eagerly. The CPU path keeps LlamaModel in fp32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.model.batch import BatchInput, InputFill
from kvcore.model.cuda_graph import CudaGraphCapturer, GraphCapturer, GraphedDecode
from kvcore.model.llama import LlamaModel

HALF_CACHE_DTYPES = ("fp16", "fp8", "int4")


class HalfLlamaModel(LlamaModel):
    """LlamaModel whose weights live on the device as float16."""

    graphs: GraphedDecode | None = None  # set by enable_cuda_graphs

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int,
                           capturer: GraphCapturer | None = None) -> GraphedDecode:
        """Run pure-decode steps of up to min(max_num_seqs, 256) sequences through CUDA graphs,
        captured per batch size on first use. `capturer`: CudaGraphCapturer by default (tests
        pass a CPU stand-in)."""
        self.graphs = GraphedDecode(self, capturer if capturer is not None else
                                    CudaGraphCapturer(), max_num_seqs, max_model_len, block_size)
        return self.graphs

    def ensure_rope(self, max_position: int) -> None:
        tables = self._cos
        super().ensure_rope(max_position)
        if self._cos is not tables and self.graphs is not None:
            self.graphs.reset()  # captured graphs read the old tables' addresses

    def _put(self, array: np.ndarray) -> Any:
        # one conversion on the host, one copy to the device; rope tables stay fp32 (not _put)
        return self.xp.asarray(np.ascontiguousarray(array, dtype=np.float16))

    def forward_device(self, batch: BatchInput, kv_cache: KVCache,
                       fill: InputFill | None = None) -> Any:
        """(L, vocab) float32 logits on the device: through a CUDA graph for pure-decode steps
        (when enabled), else eagerly. forward() is this, copied to the host."""
        if kv_cache.dtype not in HALF_CACHE_DTYPES:
            raise ValueError(f"kv_cache dtype must be one of {HALF_CACHE_DTYPES} for fp16 "
                             f"activations, got {kv_cache.dtype!r}")
        if self.graphs is not None:
            self._check(batch, kv_cache)
            logits = self.graphs.forward_device(batch, kv_cache, fill)
            if logits is not None:
                return logits
        return super().forward_device(batch, kv_cache, fill)

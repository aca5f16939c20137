"""The half-precision GPU model of DeepSeek-V2/V3 (MLA + MoE): fp16 weights on the device, cuBLAS
matmuls, the CUDA kernels (RMSNorm, RoPE, SwiGLU, the latent-cache write and the MLA tensor-core
attention, mla_attention.cu).

`HalfDeepseekModel` is DeepseekModel with HalfLlamaModel's storage and step checks: every weight
float16 on the device except the MoE router (float32, so that expert choices follow the fp32
logits), KV cache fp16 or fp8. Attention always takes the absorbed form: the query heads of a
sequence against its cached latent rows, decode rows and prefill chunks alike, in one kernel
launch per layer. The MoE routing copies the router's (T, E) logits to the host once per layer,
so its steps run eagerly (no CUDA graphs). Under NumPy (device "cpu") the same code runs with
float16 NumPy arrays, which is how the tests drive it through the emulated kernels.
"""

from __future__ import annotations

import numpy as np

from kvcore.config import ModelConfig
from kvcore.model.cuda_graph import GraphCapturer, GraphedDecode
from kvcore.model.deepseek import DeepseekModel
from kvcore.model.half_llama import HalfLlamaModel


class HalfDeepseekModel(DeepseekModel, HalfLlamaModel):
    """DeepseekModel's layers and step, HalfLlamaModel's fp16 device storage and cache checks."""

    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray],
                 device: str = "cuda") -> None:
        super().__init__(config, weights, device, mla_mode="absorbed")

    def _model_device(self, device: str) -> str:
        return device  # cuda, or cpu for NumPy float16 standing in for CuPy (tests)

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int,
                           capturer: GraphCapturer | None = None) -> GraphedDecode:
        raise ValueError("MLA models run eagerly (enforce_eager): the MoE routing reads the "
                         "router's logits back to the host in every layer")

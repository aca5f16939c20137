"""load_model: an HF-style directory -> the forward of its architecture (Llama family, DeepSeek),
in fp32 on the CPU or fp16 (on the GPU, or on the CPU as its emulation)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvcore.config import ModelConfig
from kvcore.model.deepseek import DeepseekModel
from kvcore.model.half_deepseek import HalfDeepseekModel
from kvcore.model.half_llama import HalfLlamaModel
from kvcore.model.llama import LlamaModel
from kvcore.model.quantized import GGUF_FILE, gguf_weights, quantize_weights
from kvcore.model.weights import Checkpoint, check_checkpoint, expected_shapes, iter_weights

_PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for loads at least this large


def model_class(config: ModelConfig, half: bool) -> type[LlamaModel]:
    """The forward for a checkpoint: MLA (DeepSeek) or the Llama family, fp16 or fp32."""
    if half:
        return HalfDeepseekModel if config.mla is not None else HalfLlamaModel
    return DeepseekModel if config.mla is not None else LlamaModel


def load_model(model_dir: str | Path, device: str = "cpu", weight_format: str = "none", *,
               half: bool | None = None) -> LlamaModel:
    """Read config.json and the safetensors weights of an HF-style directory into the model
    class of its architecture. `half` (default: on cuda) loads the fp16 model, which on the
    CPU is its NumPy emulation. The whole checkpoint is checked against config.json before any
    tensor is read (weights.iter_weights), so a mismatch fails with nothing loaded. The fp32
    DeepSeek (MLA) model runs on the CPU only. weight_format (quantized.resolve_quantization):
    'none' fp32, 'int8' / 'q4' quantized from the float weights, 'gguf' the blocks of the
    directory's model.gguf (the fp32 Llama family on the CPU)."""
    config = ModelConfig.from_dir(model_dir)
    half = device == "cuda" if half is None else half
    if not half and config.mla is not None and device not in ("cpu", "auto"):
        raise ValueError(f"device {device!r}: the fp32 {config.architecture} (MLA) model runs on "
                         "the CPU; on the GPU load the fp16 model (half=True)")
    cls = model_class(config, half)
    if weight_format != "none" and (half or config.mla is not None):
        raise ValueError(f"quantization {weight_format!r}: quantized weights are for the fp32 "
                         f"Llama-family model on the CPU, not the {config.architecture} "
                         f"{'fp16 ' if half else ''}model")
    checkpoint = Checkpoint(model_dir)
    if weight_format == "gguf":
        check_checkpoint(checkpoint, config)
        checkpoint.close()
        blocks = gguf_weights(Path(model_dir) / GGUF_FILE, config)
        for name, shape in expected_shapes(config).items():
            if tuple(blocks[name].shape) != shape:
                raise ValueError(f"{GGUF_FILE}: tensor {name!r} has shape "
                                 f"{tuple(blocks[name].shape)}, config.json implies {shape}")
        return LlamaModel(config, blocks, device)
    weights: dict[str, np.ndarray] = {}
    try:
        with tqdm(total=checkpoint.num_bytes, unit="B", unit_scale=True, desc="loading weights",
                  disable=True if checkpoint.num_bytes < _PROGRESS_MIN_BYTES else None) as bar:
            for name, array in iter_weights(checkpoint, config):
                weights[name] = array  # float32 views of the memory map; copied by the model
                bar.update(checkpoint.entries[name].end - checkpoint.entries[name].begin)
            if weight_format != "none":
                weights = quantize_weights(weights, weight_format)
            if cls is DeepseekModel:
                return DeepseekModel(config, weights)
            return cls(config, weights, device)
    finally:
        checkpoint.close()

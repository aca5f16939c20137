"""load_model: an HF-style directory -> the forward of its architecture (Llama family, DeepSeek)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvcore.config import ModelConfig
from kvcore.model.deepseek import DeepseekModel
from kvcore.model.llama import LlamaModel
from kvcore.model.quantized import GGUF_FILE, gguf_weights, quantize_weights
from kvcore.model.weights import Checkpoint, check_checkpoint, expected_shapes, iter_weights

_PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for loads at least this large


def load_model(model_dir: str | Path, device: str = "cpu",
               weight_format: str = "none") -> LlamaModel:
    """Read config.json and the safetensors weights of an HF-style directory. The whole
    checkpoint is checked against config.json before any tensor is read (weights.iter_weights),
    so a mismatch fails with nothing loaded. The fp32 DeepSeek (MLA) model runs on the CPU (on
    the GPU: half_llama.load_half_model, fp16). weight_format (quantized.resolve_quantization):
    'none' fp32, 'int8' / 'q4' quantized from the float weights, 'gguf' the blocks of the
    directory's model.gguf (Llama family, CPU)."""
    config = ModelConfig.from_dir(model_dir)
    if config.mla is not None and device not in ("cpu", "auto"):
        raise ValueError(f"device {device!r}: the fp32 {config.architecture} (MLA) model runs on "
                         "the CPU; on the GPU load the fp16 model (load_half_model)")
    if weight_format != "none" and config.mla is not None:
        raise ValueError(f"quantization {weight_format!r}: the {config.architecture} (MLA) "
                         "model runs with fp32 weights only")
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
    with tqdm(total=checkpoint.num_bytes, unit="B", unit_scale=True, desc="loading weights",
              disable=True if checkpoint.num_bytes < _PROGRESS_MIN_BYTES else None) as bar:
        for name, array in iter_weights(checkpoint, config):
            weights[name] = array  # float32 views of the memory map; copied once by the model
            bar.update(checkpoint.entries[name].end - checkpoint.entries[name].begin)
        if weight_format != "none":
            weights = quantize_weights(weights, weight_format)
        model = (DeepseekModel(config, weights) if config.mla is not None
                 else LlamaModel(config, weights, device))
    checkpoint.close()
    return model

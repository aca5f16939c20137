"""load_model: an HF-style directory -> the forward of its architecture (Llama family, DeepSeek)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvcore.config import ModelConfig
from kvcore.model.deepseek import DeepseekModel
from kvcore.model.llama import LlamaModel
from kvcore.model.weights import Checkpoint, iter_weights

_PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar for loads at least this large


def load_model(model_dir: str | Path, device: str = "cpu") -> LlamaModel:
    """Read config.json and the safetensors weights of an HF-style directory. The whole
    checkpoint is checked against config.json before any tensor is read (weights.iter_weights),
    so a mismatch fails with nothing loaded. The fp32 DeepSeek (MLA) model runs on the CPU (on
    the GPU: half_llama.load_half_model, fp16)."""
    config = ModelConfig.from_dir(model_dir)
    if config.mla is not None and device not in ("cpu", "auto"):
        raise ValueError(f"device {device!r}: the fp32 {config.architecture} (MLA) model runs on "
                         "the CPU; on the GPU load the fp16 model (load_half_model)")
    checkpoint = Checkpoint(model_dir)
    weights: dict[str, np.ndarray] = {}
    with tqdm(total=checkpoint.num_bytes, unit="B", unit_scale=True, desc="loading weights",
              disable=True if checkpoint.num_bytes < _PROGRESS_MIN_BYTES else None) as bar:
        for name, array in iter_weights(checkpoint, config):
            weights[name] = array  # float32 views of the memory map; copied once by the model
            bar.update(checkpoint.entries[name].end - checkpoint.entries[name].begin)
        model = (DeepseekModel(config, weights) if config.mla is not None
                 else LlamaModel(config, weights, device))
    checkpoint.close()
    return model

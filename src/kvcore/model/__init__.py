"""The model layer: safetensors weights, BatchInput and the Llama-family forward."""

from kvcore.model.batch import BatchInput
from kvcore.model.llama import LlamaModel, load_model
from kvcore.model.weights import Checkpoint, WeightsError, load_weights

__all__ = ["BatchInput", "Checkpoint", "LlamaModel", "WeightsError", "load_model", "load_weights"]

"""The model layer: safetensors weights, BatchInput, the Llama-family and DeepSeek forwards."""

from kvcore.model.batch import BatchInput, InputFill
from kvcore.model.deepseek import DeepseekModel
from kvcore.model.llama import LlamaModel
from kvcore.model.loader import load_model
from kvcore.model.weights import Checkpoint, WeightsError, load_weights

__all__ = ["BatchInput", "Checkpoint", "DeepseekModel", "InputFill", "LlamaModel", "WeightsError",
           "load_model", "load_weights"]

"""Quantized weights for the CPU model: which format a load uses, and the weights in it, read
straight from the GGUF a model was converted from (its Q4_0 / Q4_1 / Q8_0 blocks as they are,
no float32 round trip) or quantized from float weights. The linear layers, the LM head and the
embedding (which gathers rows) all hold kvcore.kernels.cpu.quant.QuantizedWeight then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kvcore.config import ModelConfig
from kvcore.kernels.cpu import quant
from kvcore.kernels.cpu.quant import BLOCK, QuantizedWeight

QUANTIZATIONS = ("auto", "none", "int8", "q4")
GGUF_FILE = "model.gguf"  # the GGUF a converted directory came from (kvcore convert keeps it)
# GGUF's block types kvcore keeps as they are: bytes per block of 32 weights
_Q = GGMLQuantizationType
_BLOCK_BYTES = {_Q.Q4_0: 18, _Q.Q4_1: 20, _Q.Q8_0: 34}


def resolve_quantization(quantization: str, model_dir: str | Path, device: str) -> str:
    """The weight format a load uses: 'none' (fp32), 'int8', 'q4', or 'gguf' (the GGUF's own
    blocks: Q4_0 / Q4_1 as q4, Q8_0 as q8). 'auto': on the CPU, a model converted from a GGUF
    keeps its quantization (measured faster at batch 1-32 with perplexity within the GGUF's own,
    docs/benchmarks.md), a float checkpoint stays fp32; on cuda always fp32/fp16."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if device == "cuda":
        if quantization not in ("auto", "none"):
            raise ValueError(f"quantization {quantization!r} runs on the CPU only; on "
                             f"--device cuda use --quantization none (fp16 weights)")
        return "none"
    has_gguf = (Path(model_dir) / GGUF_FILE).is_file()
    if quantization == "auto":
        return "gguf" if has_gguf else "none"
    if quantization == "q4" and has_gguf:
        return "gguf"
    return quantization


def is_quantized_tensor(name: str) -> bool:
    """The tensors a quantized format holds: every 2-D weight (linear layers, embedding,
    LM head); norms and biases stay float32."""
    return name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))


def quantize_weights(weights: dict[str, Any], fmt: str) -> dict[str, Any]:
    """Float weights (HF names) with every 2-D weight quantized to fmt ('int8' or 'q4')."""
    quantizer = quant.QUANTIZERS[fmt]
    return {name: quantizer(w) if is_quantized_tensor(name) else w
            for name, w in weights.items()}


def _gguf_blocks(raw: np.ndarray, kind: GGMLQuantizationType,
                 shape: tuple[int, int]) -> QuantizedWeight:
    """One GGUF tensor's raw blocks (rows, bytes) -> q4 or q8, scales widened to float32."""
    n, k = shape
    blocks = raw.reshape(n, k // BLOCK, _BLOCK_BYTES[kind])  # (N, B, bytes per block)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, B)
    rows = quant.padded(n, quant.TILE)
    cols = quant.padded(k, quant.PAD_K) // BLOCK

    def pad(array: np.ndarray) -> np.ndarray:
        out = np.zeros((rows, cols, *array.shape[2:]), array.dtype)
        out[:n, :array.shape[1]] = array
        return out

    if kind == _Q.Q8_0:
        q = pad(blocks[..., 2:].view(np.int8))
        return quant.with_corrections(QuantizedWeight("q8", shape, q.reshape(rows, -1), pad(d)))
    if kind == _Q.Q4_1:
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
    else:  # Q4_0: weight = (nibble - 8) d, a min of -8 d
        mins, packed = -8 * d, blocks[..., 2:]
    return QuantizedWeight("q4", shape, pad(packed).reshape(rows, -1), pad(d), pad(mins))


def _rope_order(rows: int, num_heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rope permutation (gguf_convert._unpermute)."""
    from kvcore.model.gguf_convert import _unpermute

    return _unpermute(np.arange(rows), num_heads)


def gguf_weights(gguf_path: str | Path, config: ModelConfig) -> dict[str, Any]:
    """Every tensor of a llama GGUF under its HF name: Q4_0 / Q4_1 / Q8_0 2-D weights as their
    blocks, any other 2-D weight quantized to q4, 1-D tensors as float32."""
    from kvcore.model.gguf_convert import hf_tensor_name

    out: dict[str, Any] = {}
    for tensor in GGUFReader(gguf_path).tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # config.json's rope_scaling
        name = hf_tensor_name(tensor.name)
        shape = tuple(reversed(tensor.shape.tolist()))
        kind = tensor.tensor_type
        order = None
        if name.endswith("q_proj.weight"):
            order = _rope_order(shape[0], config.num_heads)
        elif name.endswith("k_proj.weight"):
            order = _rope_order(shape[0], config.num_kv_heads)
        if len(shape) == 2 and kind in _BLOCK_BYTES and shape[1] % BLOCK == 0:
            weight = _gguf_blocks(np.asarray(tensor.data), kind, (shape[0], shape[1]))
            out[name] = weight if order is None else quant.concat_rows([weight], order)
            continue
        w = np.ascontiguousarray(dequantize(tensor.data, kind).reshape(shape), dtype=np.float32)
        if order is not None:
            w = w[order]
        out[name] = quant.quantize_q4(w) if len(shape) == 2 else w
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def weight_bytes(weights: dict[str, Any]) -> int:
    """Bytes the weights hold in memory (a tied LM head counted once)."""
    seen = {id(w): w for w in weights.values()}
    return sum(int(w.nbytes) for w in seen.values())


def model_weight_bytes(model: Any) -> int:
    """Bytes of a loaded model's weights (every array or QuantizedWeight it holds, once)."""
    found: dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, QuantizedWeight | np.ndarray):
            found[id(value)] = value
        elif isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif hasattr(value, "__dataclass_fields__"):
            for name in value.__dataclass_fields__:
                visit(getattr(value, name))

    for name in ("embed", "norm", "lm_head", "layers"):
        visit(getattr(model, name, None))
    return sum(int(v.nbytes) for v in found.values())


def planned_weight_bytes(config: ModelConfig, model_dir: Path | None = None) -> dict[str, int]:
    """Weight bytes in memory per format ('none', 'int8', 'q4'; 'gguf' when model_dir holds
    model.gguf: its own block types), from the shapes alone (nothing loaded)."""
    from kvcore.model.weights import expected_shapes

    shapes = expected_shapes(config)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    out = {fmt: sum(quant.format_bytes(s[0], s[1], fmt) if is_quantized_tensor(name)
                    else int(np.prod(s)) * 4 for name, s in shapes.items())
           for fmt in ("none", "int8", "q4")}
    gguf = None if model_dir is None else Path(model_dir) / GGUF_FILE
    if gguf is not None and gguf.is_file():
        total = 0
        for tensor in GGUFReader(gguf).tensors:
            shape = tuple(reversed(tensor.shape.tolist()))
            kind = tensor.tensor_type
            if tensor.name == "rope_freqs.weight":
                continue
            if len(shape) == 1:
                total += shape[0] * 4
            else:
                fmt = {_Q.Q4_0: "q4", _Q.Q4_1: "q4", _Q.Q8_0: "q8"}.get(kind, "q4")
                total += quant.format_bytes(shape[0], shape[1], fmt)
        out["gguf"] = total
    return out

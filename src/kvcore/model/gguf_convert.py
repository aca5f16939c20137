"""Convert a llama-architecture GGUF file into an HF-style model directory, atomically."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from kvcore.model.gguf_tokenizer import (
    build_tokenizer,
    generation_config,
    special_token_ids,
    tokenizer_config,
)

# the files of a converted directory; the directory only ever appears with all of them
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "generation_config.json")

# GGUF per-layer tensor name -> HF Llama name under model.layers.{i}.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, tensor or metadata)."""


def is_model_dir(path: Path) -> bool:
    """True when `path` holds every file of a converted model."""
    return path.is_dir() and all((path / name).is_file() for name in MODEL_FILES)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value of the GGUF header as Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}


def hf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM from the GGUF's llama.* metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConversionError(
            f"general.architecture {arch!r} is not supported (kvcore converts 'llama' GGUFs)")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise GGUFConversionError(f"the GGUF metadata has no 'llama.{key}'")
        return meta[f"llama.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    # float32 metadata such as 9.999999747e-06 goes back to the value the model was trained with
    eps = float(str(np.float32(need("attention.layer_norm_rms_epsilon"))))
    rope_theta = float(str(np.float32(meta.get("llama.rope.freq_base", 10000.0))))
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.attention.key_length", hidden // heads)),
        "vocab_size": int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling != "none":
        raise GGUFConversionError(f"llama.rope.scaling.type {scaling!r} is not supported")
    ids = special_token_ids(meta)
    cfg |= {f"{name}_token_id": ids[name] for name in ("bos", "eos", "pad") if name in ids}
    return cfg


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of q/k rows: per head (d/2, 2) interleave -> (2, d/2)."""
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_tensor_name(name: str) -> str:
    """The HF Llama name of a GGUF tensor name (`blk.3.attn_q.weight` -> model.layers.3...)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    raise GGUFConversionError(f"unexpected tensor {name!r} in a llama GGUF")


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, rope_theta: float,
                        original_max_position_embeddings: int = 8192) -> dict[str, Any]:
    """HF's llama3 rope_scaling from llama.cpp's rope_freqs.weight (a divisor per frequency).

    The divisors depend on (original_max_position_embeddings, low_freq_factor, high_freq_factor)
    only through smooth = (original / wavelen - low) / (high - low), a line in 1 / wavelen; so
    the original length is fixed at Llama 3's 8192 and the line through the smoothly scaled
    frequencies gives low and high. The result is checked by recomputing the divisors.
    """
    divisors = factors.astype(np.float64)
    factor = float(divisors.max())
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if divisors.shape != inv_freq.shape or factor <= 1.0:
        raise GGUFConversionError(f"rope_freqs.weight of shape {divisors.shape} does not hold "
                                  f"llama3 rope divisors for head_dim {head_dim}")
    x = inv_freq / (2 * math.pi)  # 1 / wavelen
    mid = (divisors > 1.0 + 1e-5) & (divisors < factor * (1.0 - 1e-5))
    scaling: dict[str, Any] = {"rope_type": "llama3", "factor": round(factor, 4),
                               "original_max_position_embeddings": original_max_position_embeddings}
    if mid.sum() >= 2:
        smooth = (1.0 / divisors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[mid], smooth, 1)
        span = original_max_position_embeddings / slope  # high - low
        scaling["low_freq_factor"] = round(float(-intercept * span), 4)
        scaling["high_freq_factor"] = round(float(-intercept * span + span), 4)
    else:
        scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    expected = llama3_rope_divisors(head_dim, rope_theta, scaling)
    if not np.allclose(expected, divisors, rtol=1e-4):
        raise GGUFConversionError("rope_freqs.weight is not a llama3 rope scaling that kvcore "
                                  "can express as rope_scaling")
    return scaling


def llama3_rope_divisors(head_dim: int, rope_theta: float, scaling: dict[str, Any]) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 rope_scaling (its convert_hf_to_gguf.py formula)."""
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (original / wavelen - low) / (high - low)
    divisors = 1.0 / ((1.0 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, divisors)
    return np.where(wavelen > original / low, factor, divisors)  # (head_dim // 2,)


def convert_tensors(reader: GGUFReader, cfg: dict[str, Any],
                    progress: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, q/k rows back in HF order."""
    out: dict[str, np.ndarray] = {}
    num_tensors = len(reader.tensors)
    for n, tensor in enumerate(reader.tensors):
        if tensor.name == "rope_freqs.weight":
            continue  # read into config.json's rope_scaling by write_model_dir
        name = hf_tensor_name(tensor.name)
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise GGUFConversionError(
                f"tensor {tensor.name!r}: quant type {tensor.tensor_type.name} cannot be "
                f"dequantized by the gguf package") from e
        # GGUF lists dims fastest-first; HF wants (out_features, in_features)
        w = np.ascontiguousarray(w.reshape(tuple(reversed(tensor.shape.tolist()))),
                                 dtype=np.float32)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = w
        if progress is not None and (n + 1) % 50 == 0:
            progress(f"dequantized {n + 1}/{num_tensors} tensors")
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_model_dir(gguf_path: Path, out: Path,
                    progress: Callable[[str], None] | None = None) -> None:
    """Write all of MODEL_FILES into the (existing, empty) directory `out`."""
    reader = GGUFReader(gguf_path)
    meta = read_metadata(reader)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = hf_config(meta, tied)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        if "rope_scaling" in cfg:
            kind = cfg["rope_scaling"]["rope_type"]
            raise GGUFConversionError(
                f"the GGUF has both rope_freqs.weight and llama.rope.scaling.type {kind!r}")
        cfg["rope_scaling"] = llama3_rope_scaling(
            dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1), cfg["head_dim"],
            cfg["rope_theta"])
    tokenizer = build_tokenizer(meta)  # before the slow part: an unsupported tokenizer fails fast
    tensors = convert_tensors(reader, cfg, progress)
    embed = tensors["model.embed_tokens.weight"]
    if embed.shape != (cfg["vocab_size"], cfg["hidden_size"]):
        raise GGUFConversionError(
            f"token_embd.weight has shape {embed.shape}, config says "
            f"({cfg['vocab_size']}, {cfg['hidden_size']})")
    _write_json(out / "config.json", cfg)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json",
                tokenizer_config(meta, cfg["max_position_embeddings"]))
    _write_json(out / "generation_config.json", generation_config(meta))
    # the quantized blocks, for loads that keep them (kvcore.model.quantized)
    shutil.copyfile(gguf_path, out / "model.gguf")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 progress: Callable[[str], None] | None = None) -> Path:
    """Convert `gguf_path` into the HF-style directory `out_dir`; returns `out_dir`.

    Idempotent: a complete `out_dir` is left as it is. Atomic: the files are written into a
    temporary directory beside `out_dir`, which is renamed into place only when all are written,
    so a failure never leaves a partial model behind.
    """
    src, out = Path(gguf_path), Path(out_dir)
    if is_model_dir(out):
        return out
    if not src.is_file():
        raise GGUFConversionError(f"gguf_path {str(src)!r} is not a file")
    if out.exists():
        raise GGUFConversionError(
            f"out_dir {str(out)!r} exists but is not a complete model directory; remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        write_model_dir(src, tmp, progress)
        # mkdtemp makes the directory private; a model directory is as readable as any download
        os.chmod(tmp, 0o755)
        for name in (*MODEL_FILES, "model.gguf"):
            os.chmod(tmp / name, 0o644)
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_model_dir(out):  # not another process that finished first
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out

"""Convert a llama-architecture GGUF file into an HF-style model directory, atomically."""

from __future__ import annotations

import json
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
    if stem == "rope_freqs":
        raise GGUFConversionError(
            "tensor 'rope_freqs.weight' (llama3 rope scaling factors) is not supported")
    raise GGUFConversionError(f"unexpected tensor {name!r} in a llama GGUF")


def convert_tensors(reader: GGUFReader, cfg: dict[str, Any],
                    progress: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """Dequantize every tensor to float32 under its HF name, q/k rows back in HF order."""
    out: dict[str, np.ndarray] = {}
    num_tensors = len(reader.tensors)
    for n, tensor in enumerate(reader.tensors):
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
        for name in MODEL_FILES:
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

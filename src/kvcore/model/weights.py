"""Safetensors checkpoints (single file or sharded) read as memory-mapped float32 arrays."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kvcore.config import ModelConfig
from kvcore.model.deepseek_weights import deepseek_shapes, is_unused_deepseek_tensor

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> the NumPy dtype of its raw bytes; BF16 is read as uint16 and widened
_RAW_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
# tensors some checkpoints carry that the forward recomputes (old Llama exports)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightsError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or mis-shaped tensor."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    path: Path  # the .safetensors file holding the tensor
    dtype: str  # safetensors dtype name: F32, F16, BF16, F64
    shape: tuple[int, ...]
    begin: int  # byte offset of the data in the file
    end: int


def _read_entries(path: Path) -> dict[str, TensorEntry]:
    """Tensor names, dtypes, shapes and byte ranges of one file.

    safetensors' NumPy backend cannot produce bfloat16 arrays, so the data is read through a
    memory map of the file at the offsets its header gives; safe_open checks the file first.
    """
    with safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
    with path.open("rb") as fh:
        (header_len,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(header_len))
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]),
                                    data_start + begin, data_start + end)
    if set(entries) != names:
        raise WeightsError(f"{path}: header and safetensors disagree on the tensor names")
    return entries


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The .safetensors files of a checkpoint: those its index names, else every one present."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightsError(f"{index} has no weight_map")
        files = sorted({root / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise WeightsError(f"{index} names the shard {f.name}, which is missing")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors file in {root}")
    return files


class Checkpoint:
    """All tensors of a checkpoint directory; `get` reads one as float32 through a memory map."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self.entries: dict[str, TensorEntry] = {}
        for path in checkpoint_files(self.model_dir):
            for name, entry in _read_entries(path).items():
                if name in self.entries:
                    raise WeightsError(f"tensor {name!r} appears in both "
                                       f"{self.entries[name].path.name} and {path.name}")
                self.entries[name] = entry
        index = self.model_dir / INDEX_FILE
        if index.exists():
            for name, file in json.loads(index.read_text())["weight_map"].items():
                found = self.entries.get(name)
                if found is None or found.path.name != file:
                    raise WeightsError(f"index maps tensor {name!r} to {file}, which lacks it")
        self._maps: dict[Path, np.memmap] = {}

    @property
    def num_bytes(self) -> int:
        return sum(e.end - e.begin for e in self.entries.values())

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32: a read-only view of the file for F32, else a widened copy."""
        entry = self.entries[name]
        if entry.dtype not in _RAW_DTYPES:
            raise WeightsError(f"tensor {name!r} has dtype {entry.dtype}; kvcore reads "
                               f"{', '.join(_RAW_DTYPES)}")
        data = self._maps.get(entry.path)
        if data is None:
            data = self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        raw = data[entry.begin:entry.end].view(_RAW_DTYPES[entry.dtype]).reshape(entry.shape)
        if entry.dtype == "BF16":
            # bfloat16 is the top half of a float32: shift the bits up and reinterpret
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if entry.dtype == "F32":
            return np.asarray(raw).view(np.float32)
        return raw.astype(np.float32)

    def close(self) -> None:
        self._maps.clear()


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward needs, with its shape (HF names)."""
    c = config
    if c.mla is not None:
        return deepseek_shapes(c)
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
            p + "self_attn.q_proj.weight": (q_dim, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv_dim, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv_dim, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q_dim),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_dim,),
                       p + "self_attn.k_proj.bias": (kv_dim,),
                       p + "self_attn.v_proj.bias": (kv_dim,)}
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,),
                       p + "self_attn.k_norm.weight": (c.head_dim,)}
    return shapes


def check_checkpoint(checkpoint: Checkpoint, config: ModelConfig) -> None:
    """Raise WeightsError naming the first missing, unexpected or mis-shaped tensors."""
    expected = expected_shapes(config)
    present = {n for n in checkpoint.entries if not n.endswith(_IGNORED_SUFFIXES)
               and not is_unused_deepseek_tensor(n, config)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(set(expected) - present)
    if missing:
        raise WeightsError(f"checkpoint {checkpoint.model_dir} is missing {len(missing)} "
                           f"tensor(s): {', '.join(missing[:5])}")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise WeightsError(f"checkpoint {checkpoint.model_dir} has {len(unexpected)} unexpected "
                           f"tensor(s): {', '.join(unexpected[:5])}")
    for name, shape in expected.items():
        entry = checkpoint.entries[name]
        if entry.shape != shape:
            raise WeightsError(f"tensor {name!r} has shape {entry.shape}, config.json implies "
                               f"{shape}")
        if entry.dtype not in _RAW_DTYPES:
            raise WeightsError(f"tensor {name!r} has unsupported dtype {entry.dtype}")


def iter_weights(checkpoint: Checkpoint, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(name, float32 array) for every needed tensor, after checking the whole checkpoint."""
    check_checkpoint(checkpoint, config)
    for name in expected_shapes(config):
        yield name, checkpoint.get(name)


def load_weights(model_dir: str | Path, config: ModelConfig) -> dict[str, np.ndarray]:
    """Every needed tensor as an in-memory float32 array; the LM head is the embedding if tied."""
    checkpoint = Checkpoint(model_dir)
    weights = {name: np.array(array) for name, array in iter_weights(checkpoint, config)}
    checkpoint.close()
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights

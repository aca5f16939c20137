"""Safetensors loading: sharded index, bf16/fp16 widening, tied embeddings, named errors."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvcore.cache.kv_cache import KVCache
from kvcore.config import ModelConfig
from kvcore.model import BatchInput, Checkpoint, WeightsError, load_model, load_weights
from tiny_model import make_tiny_model


def write_raw_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """A safetensors file written by hand from the format spec (NumPy cannot save bf16)."""
    header: dict[str, object] = {}
    blobs, offset = [], 0
    for name, array in tensors.items():
        data = array.tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _logits(model_dir: Path) -> np.ndarray:
    model = load_model(model_dir)
    c = model.config
    batch = BatchInput.build([[5, 17, 200, 3, 9, 44]], [0], [[1, 0]], 4)
    return model.forward(batch, KVCache(c.num_layers, 2, 4, c.num_kv_heads, c.head_dim))


def test_load_weights_returns_the_file_values(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_dir(tiny_model_dir)
    stored = load_file(str(tiny_model_dir / "model.safetensors"))
    weights = load_weights(tiny_model_dir, config)
    assert set(weights) == set(stored)
    for name, array in stored.items():
        np.testing.assert_array_equal(weights[name], array)
        assert weights[name].dtype == np.float32


def test_fp32_reads_are_memory_mapped(tiny_model_dir: Path) -> None:
    array = Checkpoint(tiny_model_dir).get("model.layers.0.mlp.up_proj.weight")
    assert not array.flags.owndata and not array.flags.writeable
    base = array
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def test_sharded_checkpoint_through_index(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = _copy_model(tiny_model_dir, tmp_path / "sharded")
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[:7], names[7:15], names[15:])):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, str(out / shard))
        weight_map |= {n: shard for n in part}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert len(Checkpoint(out).entries) == len(tensors)
    np.testing.assert_array_equal(_logits(out), _logits(tiny_model_dir))
    # a stray file that the index does not name is not read
    save_file({"junk": np.zeros(3, np.float32)}, str(out / "stray.safetensors"))
    np.testing.assert_array_equal(_logits(out), _logits(tiny_model_dir))
    (out / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00003.safetensors"):
        load_model(out)


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_half_precision_checkpoints_widen_exactly(tiny_model_dir: Path, tmp_path: Path,
                                                  dtype: str) -> None:
    out = _copy_model(tiny_model_dir, tmp_path / dtype)
    tensors = load_file(str(out / "model.safetensors"))
    np_dtype = ml_dtypes.bfloat16 if dtype == "BF16" else np.float16
    halves = {n: a.astype(np_dtype) for n, a in tensors.items()}
    if dtype == "BF16":
        write_raw_safetensors(out / "model.safetensors", halves, "BF16")
    else:
        save_file(halves, str(out / "model.safetensors"))
    weights = load_weights(out, ModelConfig.from_dir(out))
    for name, half in halves.items():
        np.testing.assert_array_equal(weights[name], half.astype(np.float32))
    logits, fp32_logits = _logits(out), _logits(tiny_model_dir)
    assert np.abs(logits - fp32_logits).max() < 0.05 * np.abs(fp32_logits).max()


def test_bf16_written_by_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from safetensors.torch import save_file as torch_save

    out = _copy_model(tiny_model_dir, tmp_path / "torch_bf16")
    tensors = load_file(str(out / "model.safetensors"))
    torch_save({n: torch.from_numpy(a).bfloat16() for n, a in tensors.items()},
               str(out / "model.safetensors"))
    weights = load_weights(out, ModelConfig.from_dir(out))
    for name, array in tensors.items():
        expected = torch.from_numpy(array).bfloat16().float().numpy()
        np.testing.assert_array_equal(weights[name], expected)


def _rewrite(model_dir: Path, edit) -> None:
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors_are_named(tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    missing = _copy_model(tiny_model_dir, tmp_path / "missing")
    _rewrite(missing, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightsError, match=r"missing .*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(missing)

    extra = _copy_model(tiny_model_dir, tmp_path / "extra")
    _rewrite(extra, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight":
                                        np.ones(16, np.float32)}))
    with pytest.raises(WeightsError, match=r"unexpected .*q_norm\.weight"):
        load_model(extra)

    shaped = _copy_model(tiny_model_dir, tmp_path / "shaped")
    _rewrite(shaped, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                         np.ones((48, 64), np.float32)}))
    with pytest.raises(WeightsError, match=r"k_proj\.weight.*\(48, 64\).*\(32, 64\)"):
        load_model(shaped)

    duplicate = _copy_model(tiny_model_dir, tmp_path / "duplicate")
    save_file({"model.norm.weight": np.ones(64, np.float32)}, str(duplicate / "b.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.norm\.weight.*both"):
        load_model(duplicate)

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_model_dir / "config.json", empty)
    with pytest.raises(WeightsError, match=r"no \*\.safetensors"):
        load_model(empty)


def test_old_rotary_buffers_are_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = _copy_model(tiny_model_dir, tmp_path / "inv_freq")
    _rewrite(out, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                      np.ones(8, np.float32)}))
    np.testing.assert_array_equal(_logits(out), _logits(tiny_model_dir))


def test_tied_embeddings(tmp_path: Path) -> None:
    tied = make_tiny_model(tmp_path / "tied", seed=5, tie_word_embeddings=True)
    weights = load_weights(tied, ModelConfig.from_dir(tied))
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))
    np.testing.assert_array_equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    model = load_model(tied)
    assert model.lm_head is model.embed  # one array, not a copy
    np.testing.assert_array_equal(model.lm_head, weights["model.embed_tokens.weight"])
    # a tied checkpoint that stores the head copy anyway still loads
    _rewrite(tied, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"]}))
    load_model(tied)
    untied = make_tiny_model(tmp_path / "untied", seed=5)
    _rewrite(untied, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(WeightsError, match=r"lm_head\.weight"):
        load_model(untied)

"""A tiny llama GGUF written with the gguf package, in the layout of llama.cpp's converter."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from tiny_model import CHATML_TEMPLATE, SPECIAL_TOKENS, byte_to_unicode

Q = GGMLQuantizationType
MERGES = ["Ġ t", "h e", "Ġt he", "1 2"]
USER_TOKEN = "<think>"  # a user-defined (not special) added token
TINY_GGUF = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "context": 256,
             "rope_theta": 50000.0, "eps": 1e-5}
# a mix of the quant types real files use, per HF tensor suffix
_QTYPES = {"self_attn.q_proj.weight": Q.Q4_1, "self_attn.k_proj.weight": Q.F16,
           "self_attn.v_proj.weight": Q.Q8_0, "self_attn.o_proj.weight": Q.Q4_0,
           "mlp.gate_proj.weight": Q.Q5_0, "mlp.up_proj.weight": Q.Q5_1,
           "mlp.down_proj.weight": Q.Q4_1, "model.embed_tokens.weight": Q.Q8_0,
           "lm_head.weight": Q.Q8_0}
_GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rows -> GGUF rope layout)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def llama_cpp_rope_factors(head_dim: int, rope_theta: float,
                           rope_scaling: dict[str, float]) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's rope_freqs.weight for a llama3 rope_scaling."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = ((old_context_len / wavelen - low_freq_factor)
                      / (high_freq_factor - low_freq_factor))
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(rope_factors, dtype=np.float32)


def tiny_tokens() -> tuple[list[str], list[int]]:
    """The vocabulary (specials, 256 byte characters, merged tokens, a user token) and types."""
    tokens = list(SPECIAL_TOKENS) + list(byte_to_unicode().values())
    tokens += [m.replace(" ", "") for m in MERGES] + [USER_TOKEN]
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS) - 1) + [4]
    return tokens, types


SPM_CORPUS = ("the cat sat on the mat. that is the thing, then the theme: at 10 to 12, "
              "a hat and a bat! it's tea time; the other three ate there")


def spm_vocab(num_merges: int = 40) -> tuple[list[str], list[int], list[float]]:
    """A sentencepiece-style vocabulary as llama.cpp stores it: <unk>, <s>, </s>, the 256
    <0xXX> byte pieces, characters, then pieces learnt by BPE on SPM_CORPUS, each with a
    distinct score (earlier merges score higher)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    text = "\u2581" + SPM_CORPUS.replace(" ", "\u2581")
    chars = sorted(set(text) | set("éabcdefghijklmnopqrstuvwxyz"))
    tokens += chars
    types += [1] * len(chars)
    scores += [-1000.0 - i for i in range(len(chars))]
    words = [list(w) for w in text.replace("\u2581", " \u2581").split(" ") if w]
    for k in range(num_merges):
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for pair in zip(w, w[1:], strict=False):
                counts[pair] = counts.get(pair, 0) + 1
        if not counts:
            break
        best = max(sorted(counts), key=lambda p: counts[p])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i:i + 2] = [w[i] + w[i + 1]]
                i += 1
        if best[0] + best[1] not in tokens:
            tokens.append(best[0] + best[1])
            types.append(1)
            scores.append(-float(k))
    return tokens, types, scores


def _hf_weights(rng: np.random.Generator, vocab: int, tied: bool) -> dict[str, np.ndarray]:
    g = TINY_GGUF
    head_dim = g["hidden"] // g["heads"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab, g["hidden"]),
         "model.norm.weight": 1 + normal(g["hidden"])}
    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + normal(g["hidden"])
        w[p + "post_attention_layernorm.weight"] = 1 + normal(g["hidden"])
        w[p + "self_attn.q_proj.weight"] = normal(g["heads"] * head_dim, g["hidden"])
        w[p + "self_attn.k_proj.weight"] = normal(g["kv_heads"] * head_dim, g["hidden"])
        w[p + "self_attn.v_proj.weight"] = normal(g["kv_heads"] * head_dim, g["hidden"])
        w[p + "self_attn.o_proj.weight"] = normal(g["hidden"], g["heads"] * head_dim)
        w[p + "mlp.gate_proj.weight"] = normal(g["ffn"], g["hidden"])
        w[p + "mlp.up_proj.weight"] = normal(g["ffn"], g["hidden"])
        w[p + "mlp.down_proj.weight"] = normal(g["hidden"], g["ffn"])
    if not tied:
        w["lm_head.weight"] = normal(vocab, g["hidden"])
    return w


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]


def make_tiny_gguf(path: str | Path, *, seed: int = 0, tied: bool = True, arch: str = "llama",
                   tokenizer_model: str = "gpt2", pre: str = "smollm",
                   chat_template: str | None = CHATML_TEMPLATE,
                   rope_scaling: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """Write the GGUF at `path`; returns the HF tensors the conversion must give back exactly
    (each weight after its quantization round trip, q/k rows in HF order)."""
    g = TINY_GGUF
    if tokenizer_model == "llama":  # sentencepiece: scores instead of merges, BOS added
        tokens, types, scores = spm_vocab()
        tokenizer_meta: dict[str, Any] = {"token_scores": scores, "add_space_prefix": True}
    else:
        (tokens, types), scores = tiny_tokens(), []
        tokenizer_meta = {"tokenizer_pre": pre, "token_merges": MERGES, "add_bos_token": False}
    hf = _hf_weights(np.random.default_rng(seed), len(tokens), tied)
    writer = GGUFWriter(str(path), arch)
    meta: dict[str, Any] = {
        "block_count": g["layers"], "context_length": g["context"],
        "embedding_length": g["hidden"], "feed_forward_length": g["ffn"],
        "head_count": g["heads"], "head_count_kv": g["kv_heads"],
        "rope_freq_base": g["rope_theta"], "layer_norm_rms_eps": g["eps"],
        "rope_dimension_count": g["hidden"] // g["heads"], "vocab_size": len(tokens),
        "tokenizer_model": tokenizer_model, "token_list": tokens, "token_types": types,
        "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0, "pad_token_id": 2,
    } | tokenizer_meta
    for key, value in meta.items():
        getattr(writer, f"add_{key}")(value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if rope_scaling is not None:  # llama 3.1: the rope divisors as a tensor, not metadata
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(
            g["hidden"] // g["heads"], g["rope_theta"], rope_scaling))
    expected = {}
    for name, w in hf.items():
        qtype = _QTYPES.get(name.split(".", 3)[-1] if "layers" in name else name, Q.F32)
        stored = w
        if name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(w, g["heads"])
        elif name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(w, g["kv_heads"])
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(name), stored)
            expected[name] = w
        elif qtype == Q.F16:
            writer.add_tensor(_gguf_name(name), stored.astype(np.float16))
            expected[name] = w.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(_gguf_name(name), quantize(stored, qtype), raw_dtype=qtype)
            # quantization works row by row, so it commutes with the row permutation
            expected[name] = dequantize(quantize(w, qtype), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected

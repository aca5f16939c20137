"""A tiny random-weight HF-style checkpoint (Llama, Mistral, Qwen2/3), byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def tiny_config(arch: str = "llama", **overrides: Any) -> dict[str, Any]:
    """config.json of the tiny model: 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 259."""
    if arch not in _ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(_ARCHITECTURES)}, got {arch!r}")
    cfg: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 3 + 256,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
    }
    if arch == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False}
    elif arch == "mistral":
        cfg |= {"sliding_window": 16}
    else:
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2}
        if arch == "qwen3":
            cfg |= {"attention_bias": False}
    cfg |= overrides
    return cfg


def tiny_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 weights at a realistic scale (logits spread, attention not uniform)."""
    rng = np.random.default_rng(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    bias = cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias"))

    def normal(*shape: int, std: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm_weight() -> np.ndarray:
        return (1.0 + rng.standard_normal(hidden) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, std=0.5),
         "model.norm.weight": norm_weight()}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight()
        w[p + "post_attention_layernorm.weight"] = norm_weight()
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        if bias:
            w[p + "self_attn.q_proj.bias"] = normal(heads * head_dim, std=0.1)
            w[p + "self_attn.k_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
            w[p + "self_attn.v_proj.bias"] = normal(kv_heads * head_dim, std=0.1)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = (1.0 + rng.standard_normal(head_dim) * 0.2).astype(
                np.float32)
            w[p + "self_attn.k_norm.weight"] = (1.0 + rng.standard_normal(head_dim) * 0.2).astype(
                np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = normal(cfg["vocab_size"], hidden, std=0.1)
    return w


def write_tokenizer(path: Path) -> None:
    """tokenizer.json (byte-level BPE, no merges), tokenizer_config.json, generation_config.json."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {ch: len(SPECIAL_TOKENS) + b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 1024,
        "chat_template": CHATML_TEMPLATE,
    }, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}, indent=2))


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0,
                    **overrides: Any) -> Path:
    """Write a complete tiny checkpoint into `path`; `overrides` replace config.json fields."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(arch, **overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tiny_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out)
    return out

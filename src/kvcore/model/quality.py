"""Output quality of a model variant against a baseline on the same text: perplexity (the mean
next-token log-likelihood) and top-1 agreement (how often both predict the same next token).

A variant is a weight format and a KV-cache dtype ("int8", "q4:fp16"): the text is split into
windows scored independently (each a fresh sequence, prefilled in chunks through the paged
cache), so every variant sees exactly the same contexts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvcore.cache.kv_cache import KVCache
from kvcore.model.batch import BatchInput

WINDOW = 1024  # tokens per independently scored window
CHUNK = 256  # tokens per prefill step within a window
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Variant:
    """What a comparison varies: the weight format and the KV-cache dtype."""

    quantization: str  # "none", "int8", "q4", "auto" (kvcore.model.quantized)
    cache_dtype: str = "fp32"

    @property
    def label(self) -> str:
        return self.quantization if self.cache_dtype == "fp32" else \
            f"{self.quantization}:{self.cache_dtype}"

    @classmethod
    def parse(cls, text: str) -> Variant:
        """'int8' or 'int8:fp16' (weights, then the KV-cache dtype)."""
        quantization, _, cache_dtype = text.partition(":")
        return cls(quantization, cache_dtype or "fp32")


@dataclass(frozen=True, slots=True)
class TextScore:
    """Per predicted position of a text (every token after the first of each window)."""

    nll: np.ndarray  # (P,) float64, -log p(actual next token)
    top1: np.ndarray  # (P,) int64, the most likely next token

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))

    def agreement(self, other: TextScore) -> float:
        """Fraction of positions where both predict the same next token."""
        return float((self.top1 == other.top1).mean())


def text_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, np.int64).tobytes()).hexdigest()[:16]


def _log_softmax_at(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """(rows,) log p(targets) from (rows, vocab) float32 logits, in float64."""
    x = logits.astype(np.float64)
    peak = x.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(x - peak).sum(axis=1)) + peak[:, 0]
    return x[np.arange(len(targets)), targets] - log_norm


def score_text(model: Any, token_ids: list[int], cache_dtype: str = "fp32",
               window: int = WINDOW, chunk: int = CHUNK) -> TextScore:
    """Next-token log-likelihoods and argmax predictions of `model` over `token_ids`."""
    if len(token_ids) < 2:
        raise ValueError(f"token_ids must hold at least 2 tokens, got {len(token_ids)}")
    kv_heads, width, shared = model.config.kv_layout
    num_blocks = -(-window // BLOCK_SIZE)
    cache = KVCache(model.config.num_layers, num_blocks, BLOCK_SIZE, kv_heads, width,
                    cache_dtype, shared_kv=shared)
    table = list(range(num_blocks))
    nll, top1 = [], []
    for start in range(0, len(token_ids) - 1, window):
        ids = token_ids[start:start + window + 1]  # the window and the token after it
        inputs = ids[:-1]
        for offset in range(0, len(inputs), chunk):
            part = inputs[offset:offset + chunk]
            batch = BatchInput.build([part], [offset], [table], BLOCK_SIZE)
            batch = replace(batch, logits_indices=np.arange(len(part), dtype=np.int64))
            logits = model.forward(batch, cache)  # (len(part), vocab)
            targets = np.asarray(ids[offset + 1:offset + 1 + len(part)], np.int64)
            nll.append(-_log_softmax_at(logits, targets))
            top1.append(logits.argmax(axis=1).astype(np.int64))
    return TextScore(np.concatenate(nll), np.concatenate(top1))

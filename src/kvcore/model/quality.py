"""Output quality of a model variant against a baseline on the same text: perplexity (the mean
next-token log-likelihood), the mean KL divergence of the next-token distributions from the
baseline's, top-1 agreement (how often both predict the same next token), and the agreement of
greedy generations.

A variant is a weight format and a KV-cache dtype ("int8", "q4:fp16", "auto:int4-g32-r64"): every
variant sees exactly the same contexts (kvcore.model.quality_runs scores them in lockstep).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

QUANTIZATIONS = ("none", "int8", "q4", "auto")
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int4")
_INT4 = re.compile(r"int4(?:-g(\d+))?(?:-r(\d+))?")


@dataclass(frozen=True, slots=True)
class Variant:
    """What a comparison varies: the weight format and the KV-cache dtype (int4: its value group
    size and fp16 window, None for the defaults the caller applies)."""

    quantization: str  # "none", "int8", "q4", "auto" (kvcore.model.quantized)
    cache_dtype: str = "fp32"
    int4_group: int | None = None
    int4_window: int | None = None

    @property
    def kv_label(self) -> str:
        if self.cache_dtype != "int4":
            return self.cache_dtype
        group = "" if self.int4_group is None else f"-g{self.int4_group}"
        window = "" if self.int4_window is None else f"-r{self.int4_window}"
        return f"int4{group}{window}"

    @property
    def label(self) -> str:
        return self.quantization if self.cache_dtype == "fp32" else \
            f"{self.quantization}:{self.kv_label}"

    @classmethod
    def parse(cls, text: str, param: str = "--formats") -> Variant:
        """'int8' or 'int8:fp16' or 'auto:int4-g64-r32' (weights, then the KV-cache dtype);
        ValueError naming `param` and the text otherwise."""
        quantization, _, kv = text.strip().partition(":")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"{param}: unknown weight format {quantization!r} in {text!r} "
                             f"(one of {', '.join(QUANTIZATIONS)})")
        return replace_kv(cls(quantization), kv or "fp32", param)


def replace_kv(variant: Variant, kv: str, param: str = "--kv-dtypes") -> Variant:
    """`variant` with the KV dtype `kv` ('fp16', 'int4', 'int4-g64-r32'), checked."""
    kv = kv.strip()
    if kv in KV_DTYPES[:-1]:
        return Variant(variant.quantization, kv)
    match = _INT4.fullmatch(kv)
    if match is None:
        raise ValueError(f"{param}: unknown KV cache dtype {kv!r} (one of {', '.join(KV_DTYPES)}; "
                         "int4 optionally -gGROUP and -rWINDOW, e.g. int4-g32-r64)")
    group, window = (None if g is None else int(g) for g in match.groups())
    if group is not None and group <= 0:
        raise ValueError(f"{param}: int4 group must be positive, got {group} in {kv!r}")
    return Variant(variant.quantization, "int4", group, window)


@dataclass(frozen=True, slots=True)
class TextScore:
    """Per predicted position of a text (every token after the first of each window)."""

    nll: np.ndarray  # (P,) float64, -log p(actual next token)
    top1: np.ndarray  # (P,) int64, the most likely next token
    kl: np.ndarray  # (P,) float64, KL(baseline || this) of the next-token distributions

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.nll.mean()))

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean())

    def agreement(self, other: TextScore) -> float:
        """Fraction of positions where both predict the same next token."""
        return float((self.top1 == other.top1).mean())


def text_digest(token_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(token_ids, np.int64).tobytes()).hexdigest()[:16]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(rows, vocab) log-probabilities in float64 from (rows, vocab) logits."""
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def next_token_stats(logprobs: np.ndarray, targets: np.ndarray,
                     base_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nll, top1, kl) per row: -log p(target), argmax, and KL(base || this) =
    sum_v p_base(v) (log p_base(v) - log p(v)), from (rows, vocab) log-probabilities."""
    rows = np.arange(len(targets))
    kl = (np.exp(base_logprobs) * (base_logprobs - logprobs)).sum(axis=1)
    return -logprobs[rows, targets], logprobs.argmax(axis=1).astype(np.int64), kl


def greedy_agreement(baseline: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]]) -> float:
    """The fraction of the baseline's greedy tokens a variant reproduces before it first
    differs, over all prompts (1.0: every output identical; after a difference greedy outputs
    diverge, so later coincidences are not counted)."""
    if len(baseline) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(baseline)} baseline outputs")
    total = sum(len(b) for b in baseline)
    if total == 0:
        return 1.0
    matched = 0
    for base, out in zip(baseline, outputs, strict=True):
        for a, b in zip(base, out, strict=False):
            if a != b:
                break
            matched += 1
    return matched / total

"""Batched logits processors over (B, V) float32 host logits, each row with its own parameters.

Every function works on a subset of rows given by index arrays and changes `logits` in place, so
rows that do not need a processor cost nothing. Order used by the sampler (vLLM v1's): logit_bias,
min_tokens, repetition penalty, frequency/presence penalties, then (random rows only)
temperature, min_p, top_k, top_p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEG_INF = np.float32(-np.inf)


def token_pairs(token_lists: Sequence[Sequence[int]], rows: np.ndarray,
                vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (row, token_id) pairs of `token_lists[i]` for row `rows[i]`, with their counts.

    Returns (pair_rows, pair_tokens, counts), all (P,) int64; one np.unique over the whole batch.
    """
    lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
    if lengths.sum() == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_lists])  # (N,)
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ValueError(f"token id {bad} is outside the vocabulary of size {vocab_size}")
    keys = np.repeat(np.asarray(rows, dtype=np.int64), lengths) * vocab_size + tokens  # (N,)
    unique_keys, counts = np.unique(keys, return_counts=True)
    return unique_keys // vocab_size, unique_keys % vocab_size, counts.astype(np.int64)


def apply_logit_bias(logits: np.ndarray, rows: np.ndarray, token_ids: np.ndarray,
                     biases: np.ndarray) -> None:
    """Add biases[i] to logits[rows[i], token_ids[i]]; pairs are distinct (one dict per row)."""
    logits[rows, token_ids] += biases.astype(np.float32)


def apply_repetition_penalty(logits: np.ndarray, pair_rows: np.ndarray, pair_tokens: np.ndarray,
                             penalties: np.ndarray) -> None:
    """HF/vLLM: for every token seen in the prompt or output, divide a positive logit by the
    penalty and multiply a negative one. `penalties` is (B,) indexed by row."""
    values = logits[pair_rows, pair_tokens]
    penalty = penalties[pair_rows].astype(np.float32)
    logits[pair_rows, pair_tokens] = np.where(values > 0, values / penalty, values * penalty)


def apply_frequency_presence(logits: np.ndarray, pair_rows: np.ndarray, pair_tokens: np.ndarray,
                             counts: np.ndarray, frequency: np.ndarray,
                             presence: np.ndarray) -> None:
    """OpenAI: subtract frequency * count + presence * (count > 0) over OUTPUT tokens.
    `frequency` and `presence` are (B,) indexed by row; pairs have count >= 1."""
    penalty = frequency[pair_rows] * counts + presence[pair_rows]
    logits[pair_rows, pair_tokens] -= penalty.astype(np.float32)


def mask_tokens(logits: np.ndarray, rows: np.ndarray, token_ids: np.ndarray) -> None:
    """Set logits[rows[i], token_ids[i]] to -inf (min_tokens: EOS and stop tokens)."""
    logits[rows, token_ids] = NEG_INF


def apply_temperature(logits: np.ndarray, rows: np.ndarray, temperatures: np.ndarray) -> None:
    """Divide row rows[i] by temperatures[i] (> 0)."""
    logits[rows] /= temperatures.astype(np.float32)[:, None]


def apply_min_p(logits: np.ndarray, rows: np.ndarray, min_p: np.ndarray) -> None:
    """Drop tokens whose probability is below min_p[i] * the row's highest probability.

    p_j / p_max = exp(l_j - l_max), so the test needs no softmax: l_j < l_max + log(min_p)."""
    sub = logits[rows]  # (R, V)
    threshold = sub.max(axis=1).astype(np.float64) + np.log(min_p.astype(np.float64))  # (R,)
    sub[sub < threshold[:, None]] = NEG_INF
    logits[rows] = sub


def apply_top_k(logits: np.ndarray, rows: np.ndarray, top_k: np.ndarray) -> None:
    """Keep the top_k[i] highest logits of row rows[i] (tokens tied with the k-th are kept)."""
    vocab_size = logits.shape[1]
    k = np.minimum(top_k.astype(np.int64), vocab_size)
    sub = logits[rows]  # (R, V)
    k_max = int(k.max())
    # the k_max largest per row without a full sort: partition, then sort only those
    largest = -np.partition(-sub, k_max - 1, axis=1)[:, :k_max]  # (R, k_max)
    largest = -np.sort(-largest, axis=1)  # descending
    threshold = largest[np.arange(len(rows)), k - 1]  # (R,) the k-th largest value
    sub[sub < threshold[:, None]] = NEG_INF
    logits[rows] = sub


def apply_top_p(logits: np.ndarray, rows: np.ndarray, top_p: np.ndarray) -> None:
    """Nucleus (vLLM semantics): sort ascending, drop tokens while the cumulative probability of
    the dropped ones stays <= 1 - top_p; the most likely token always survives."""
    sub = logits[rows]  # (R, V)
    order = np.argsort(sub, axis=1, kind="stable")  # (R, V) ascending
    sorted_logits = np.take_along_axis(sub, order, axis=1).astype(np.float64)
    # float64: a float32 cumsum over a large vocabulary drifts by ~V * eps near the cut
    probs = np.exp(sorted_logits - sorted_logits[:, -1:])
    cum = np.cumsum(probs, axis=1)
    cum /= cum[:, -1:]
    drop = cum <= (1.0 - top_p.astype(np.float64))[:, None]
    drop[:, -1] = False
    drop_rows, drop_cols = np.nonzero(drop)
    sub[drop_rows, order[drop_rows, drop_cols]] = NEG_INF
    logits[rows] = sub


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (R, V); -inf logits stay -inf."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x

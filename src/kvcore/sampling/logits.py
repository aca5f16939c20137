"""Batched logits processors over (B, V) float32 host logits, each row with its own parameters.

Every function works on a subset of rows given by index arrays and changes `logits` in place, so
rows that do not need a processor cost nothing. Order used by the sampler (vLLM v1's): logit_bias,
min_tokens, repetition penalty, frequency/presence penalties, then (random rows only)
temperature, min_p, top_k, top_p.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcore.device import array_module

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


def _select(logits: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, bool]:
    """logits[rows]: a view when rows is the whole batch in order (no copy, no write-back)."""
    whole = len(rows) == logits.shape[0] and bool((rows == np.arange(len(rows))).all())
    return (logits if whole else logits[rows]), whole


def apply_temperature(logits: np.ndarray, rows: np.ndarray, temperatures: np.ndarray) -> None:
    """Divide row rows[i] by temperatures[i] (> 0)."""
    sub, whole = _select(logits, rows)
    sub /= temperatures.astype(np.float32)[:, None]
    if not whole:
        logits[rows] = sub


def apply_min_p(logits: np.ndarray, rows: np.ndarray, min_p: np.ndarray) -> None:
    """Drop tokens whose probability is below min_p[i] * the row's highest probability.

    p_j / p_max = exp(l_j - l_max), so the test needs no softmax: l_j < l_max + log(min_p)."""
    sub, whole = _select(logits, rows)  # (R, V)
    threshold = sub.max(axis=1).astype(np.float64) + np.log(min_p.astype(np.float64))  # (R,)
    sub[sub < threshold[:, None]] = NEG_INF
    if not whole:
        logits[rows] = sub


def apply_top_k(logits: np.ndarray, rows: np.ndarray, top_k: np.ndarray) -> None:
    """Keep the top_k[i] highest logits of row rows[i] (tokens tied with the k-th are kept)."""
    vocab_size = logits.shape[1]
    k = np.minimum(top_k.astype(np.int64), vocab_size)
    sub, whole = _select(logits, rows)  # (R, V)
    k_max = int(k.max())
    # the k_max largest per row without a full sort: partition, then sort only those
    largest = -np.partition(-sub, k_max - 1, axis=1)[:, :k_max]  # (R, k_max)
    largest = -np.sort(-largest, axis=1)  # descending
    threshold = largest[np.arange(len(rows)), k - 1]  # (R,) the k-th largest value
    sub[sub < threshold[:, None]] = NEG_INF
    if not whole:
        logits[rows] = sub


def apply_top_p(logits: np.ndarray, rows: np.ndarray, top_p: np.ndarray,
                window: int = 128) -> None:
    """Nucleus (vLLM semantics): in descending probability order a token is kept while the mass
    of the tokens above it is < top_p (vLLM: sorted ascending, drop while the cumulative mass
    <= 1 - top_p); the most likely token always survives.

    No full sort of the vocabulary: the cut is searched among the `window` most likely tokens,
    and the window grows x8 for rows whose nucleus is wider (at worst, a full sort)."""
    vocab_size = logits.shape[1]
    sub, whole = _select(logits, rows)  # (R, V)
    peak = sub.max(axis=1, keepdims=True)  # (R, 1)
    # float64 sums: a float32 running sum over a large vocabulary drifts by ~V * eps at the cut
    total = np.exp(sub - peak).sum(axis=1, dtype=np.float64)  # (R,) unnormalized mass
    pending = np.arange(len(rows))
    size = min(window, vocab_size)
    while len(pending):
        x = sub if len(pending) == len(rows) else sub[pending]  # (P, V)
        if size < vocab_size:
            # on -x: the -inf ties (masked tokens) land past kth, which introselect handles
            # fast; partitioning x at V - size with them below is ~5x slower
            top = np.argpartition(-x, size - 1, axis=1)[:, :size]  # (P, size)
        else:
            top = np.broadcast_to(np.arange(vocab_size), x.shape)
        top_logits = np.take_along_axis(x, top, axis=1)  # (P, size)
        order = np.argsort(-top_logits, axis=1, kind="stable")
        top = np.take_along_axis(top, order, axis=1)  # by probability, descending
        probs = np.exp(np.take_along_axis(top_logits, order, axis=1).astype(np.float64)
                       - peak[pending])  # (P, size)
        above = (np.cumsum(probs, axis=1) - probs) / total[pending, None]
        num_keep = np.maximum((above < top_p[pending, None]).sum(axis=1), 1)  # (P,)
        # resolved: the first dropped token lies inside the window (or the window is everything)
        done = (num_keep < size) | (size == vocab_size)
        resolved = np.flatnonzero(done)
        keep = np.arange(size) < num_keep[resolved, None]  # (D, size)
        keep_rows = np.broadcast_to(pending[resolved, None], keep.shape)[keep]
        keep_ids = top[resolved][keep]
        values = sub[keep_rows, keep_ids]
        sub[pending[resolved]] = NEG_INF
        sub[keep_rows, keep_ids] = values
        pending = pending[~done]
        size = min(size * 8, vocab_size)
    if not whole:
        logits[rows] = sub


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Row-wise log(sum(exp(x))) (R,) float64: float32 exponentials, float64 accumulation."""
    peak = logits.max(axis=1, keepdims=True)  # (R, 1)
    sums = np.exp(logits - peak).sum(axis=1, dtype=np.float64)
    return peak[:, 0].astype(np.float64) + np.log(sums)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (R, V); -inf logits stay -inf. On the logits' device
    (NumPy or CuPy)."""
    xp = array_module(logits)
    x = logits.astype(xp.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= xp.log(xp.exp(x).sum(axis=1, keepdims=True))
    return x

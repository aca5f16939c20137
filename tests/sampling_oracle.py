"""The NumPy reference sampler (the oracle the xp sampler is checked against): processes (B, V)
logits by each row's parameters, draws tokens from per-row NumPy generators, logprobs. Nothing in
kvcore runs it; tests compare against it (chi-square, equality of greedy rows and logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvcore.sampling import logits as lp
from kvcore.sampling.params import TokenLogprob
from kvcore.sampling.rows import SamplerOutput, SamplingRow
from kvcore.sampling.xp_batch import ProcessorPairs


def make_generator(seed: int | None, seed_sequence: np.random.SeedSequence) -> np.random.Generator:
    """A request's own generator: PCG64(seed) when it has a seed, so the same seed gives the same
    output whatever else is in the batch; otherwise a child of the engine's seed sequence."""
    if seed is None:
        return np.random.Generator(np.random.PCG64(seed_sequence.spawn(1)[0]))
    # SeedSequence takes non-negative entropy; map a negative seed onto [2**63, 2**64)
    return np.random.Generator(np.random.PCG64(seed % 2**64))


class Sampler:
    """Samples one token per row. Logprobs are those of the RAW model distribution: the
    log-softmax of the logits before any processor (vLLM's default logprobs_mode=raw_logprobs)."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: np.ndarray, rows: Sequence[SamplingRow],
                 generators: Sequence[np.random.Generator | None] | None = None) -> SamplerOutput:
        """`logits` (B, V) float32, one row per entry of `rows` (and of `generators`, each
        required unless its row is greedy); `logits` is modified in place."""
        gens = list(generators) if generators is not None else [None] * len(rows)
        if logits.ndim != 2 or logits.shape[0] != len(rows) or logits.dtype != np.float32:
            raise ValueError(f"logits must be float32 (B={len(rows)}, V), got "
                             f"{logits.dtype} {logits.shape}")
        num_rows = logits.shape[0]
        want = np.flatnonzero([r.params.logprobs is not None for r in rows])  # (W,)
        # raw logprobs: saved before any processor touches the logits
        raw = logits[want]  # (W, V) copy
        raw_lse = lp.logsumexp(raw) if len(want) else None

        greedy = process_logits(logits, rows, self.eos_token_ids)  # (B,) bool
        token_ids = np.empty(num_rows, dtype=np.int64)  # (B,)
        if greedy.all():
            token_ids[:] = logits.argmax(axis=1)
        elif greedy.any():
            token_ids[greedy] = logits[greedy].argmax(axis=1)
        random_rows = np.flatnonzero(~greedy)
        if len(random_rows):
            sub = logits if len(random_rows) == num_rows else logits[random_rows]
            token_ids[random_rows] = draw(sub, [gens[int(i)] for i in random_rows])

        out: list[TokenLogprob | None] = [None] * num_rows
        for j, i in enumerate(want):
            k = rows[int(i)].params.logprobs
            assert k is not None and raw_lse is not None
            out[int(i)] = _token_logprob(raw[j], float(raw_lse[j]), int(token_ids[i]), k)
        return SamplerOutput(token_ids=token_ids, logprobs=out)


def process_logits(logits: np.ndarray, rows: Sequence[SamplingRow],
                   eos_token_ids: Sequence[int]) -> np.ndarray:
    """Apply every row's processors to `logits` (B, V) float32 in place; returns the (B,) greedy
    mask. All rows: logit_bias, min_tokens, repetition, frequency/presence penalties. Random rows
    only (greedy rows need just the argmax): temperature, min_p, top_k, top_p."""
    vocab_size = logits.shape[1]
    pairs = ProcessorPairs.from_rows(rows, eos_token_ids, vocab_size)
    if pairs.bias is not None:
        lp.apply_logit_bias(logits, *pairs.bias)
    if pairs.stop_mask is not None:
        lp.mask_tokens(logits, *pairs.stop_mask)
    if pairs.repetition is not None:
        lp.apply_repetition_penalty(logits, *pairs.repetition)
    if pairs.frequency is not None:
        lp.apply_frequency_presence(logits, *pairs.frequency)

    greedy = np.array([r.params.greedy for r in rows], dtype=bool)  # (B,)
    params = [r.params for r in rows]
    random = ~greedy
    if random.any():
        temperature = np.array([p.temperature for p in params])  # (B,)
        lp.apply_temperature(logits, np.flatnonzero(random), temperature[random])
    min_p = np.array([p.min_p for p in params])  # (B,)
    sel = np.flatnonzero(random & (min_p > 0))
    if len(sel):
        lp.apply_min_p(logits, sel, min_p[sel])
    top_k = np.array([p.top_k or vocab_size for p in params])  # (B,)
    sel = np.flatnonzero(random & (top_k < vocab_size))
    if len(sel):
        lp.apply_top_k(logits, sel, top_k[sel])
    top_p = np.array([p.top_p for p in params])  # (B,)
    sel = np.flatnonzero(random & (top_p < 1.0))
    if len(sel):
        lp.apply_top_p(logits, sel, top_p[sel])
    return greedy


DRAW_BLOCK = 1024  # tokens per block of the two-level inverse-CDF search


def draw(logits: np.ndarray, generators: Sequence[np.random.Generator | None]) -> np.ndarray:
    """One inverse-CDF draw per row of processed `logits` (R, V) from the row's own generator
    (one uniform per row): a row's token depends only on its logits and its generator, never on
    the rest of the batch. Returns (R,) int64.

    Two levels instead of a cumsum over the whole vocabulary: block masses (float64 sums), pick
    the block, then a cumsum inside that block only."""
    vocab_size = logits.shape[1]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))  # (R, V) unnormalized, float32
    starts = np.arange(0, vocab_size, DRAW_BLOCK)
    # float32 block sums (pairwise, accurate to ~1e-7), float64 running sum across blocks
    block_cdf = np.cumsum(np.add.reduceat(probs, starts, axis=1), axis=1,
                          dtype=np.float64)  # (R, num_blocks)
    token_ids = np.empty(len(generators), dtype=np.int64)  # (R,)
    for i, generator in enumerate(generators):
        if generator is None:
            raise ValueError("a random (non-greedy) row needs a generator, got None")
        target = generator.random() * block_cdf[i, -1]
        block = int(np.searchsorted(block_cdf[i], target, side="right"))
        if block >= len(starts):  # u * total rounded up to total
            block = int(np.flatnonzero(np.diff(block_cdf[i], prepend=0.0) > 0)[-1])
            target = block_cdf[i, -1]
        base = block_cdf[i, block - 1] if block else 0.0
        inner = probs[i, starts[block]:starts[block] + DRAW_BLOCK]
        offset = int(np.searchsorted(np.cumsum(inner, dtype=np.float64), target - base,
                                     side="right"))
        if offset >= len(inner):  # the two sums rounded differently: the block's last live token
            offset = int(np.flatnonzero(inner)[-1])
        token_ids[i] = starts[block] + offset
    return token_ids


def _token_logprob(raw: np.ndarray, lse: float, token_id: int, k: int) -> TokenLogprob:
    """The chosen token's raw logprob and the k best (token_id, logprob), best first; a logprob
    is logit - logsumexp, so only the k + 1 entries reported are ever computed."""
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        k = min(k, raw.shape[0])
        best = np.argpartition(-raw, k - 1)[:k]
        # by logit descending, then token id, so ties come out in a fixed order
        best = best[np.lexsort((best, -raw[best]))]
        top = tuple((int(t), float(raw[t]) - lse) for t in best)
    return TokenLogprob(token_id=token_id, logprob=float(raw[token_id]) - lse, top=top)

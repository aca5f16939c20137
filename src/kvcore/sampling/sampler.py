"""The batch sampler: processes (B, V) logits row by row's parameters, draws tokens, logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvcore.sampling import logits as lp
from kvcore.sampling.params import SamplingParams, TokenLogprob


def make_generator(seed: int | None, seed_sequence: np.random.SeedSequence) -> np.random.Generator:
    """A request's own generator: PCG64(seed) when it has a seed, so the same seed gives the same
    output whatever else is in the batch; otherwise a child of the engine's seed sequence."""
    if seed is None:
        return np.random.Generator(np.random.PCG64(seed_sequence.spawn(1)[0]))
    # SeedSequence takes non-negative entropy; map a negative seed onto [2**63, 2**64)
    return np.random.Generator(np.random.PCG64(seed % 2**64))


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of the logits batch: a sequence that samples this step."""

    params: SamplingParams
    generator: np.random.Generator | None  # required unless params.greedy
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far (before this step's)
    seed: int | None = None  # the xp sampler's per-sequence seed (rng.make_seed); unused here
    # the xp sampler's output position (tokens generated so far) when output_token_ids is left
    # empty because no processor reads the history; None: len(output_token_ids)
    position: int | None = None
    # a constrained row's packed token bitmask, (ceil(V / 32),) int32 (constraints.MaskFiller)
    token_mask: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: np.ndarray  # (B,) int64, the sampled token of each row
    logprobs: list[TokenLogprob | None]  # per row; None where params.logprobs is None


class Sampler:
    """Samples one token per row. Logprobs are those of the RAW model distribution: the
    log-softmax of the logits before any processor (vLLM's default logprobs_mode=raw_logprobs)."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: np.ndarray, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """`logits` (B, V) float32, one row per entry of `rows`; it is modified in place."""
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
            token_ids[random_rows] = draw(sub, [rows[int(i)].generator for i in random_rows])

        out: list[TokenLogprob | None] = [None] * num_rows
        for j, i in enumerate(want):
            k = rows[int(i)].params.logprobs
            assert k is not None and raw_lse is not None
            out[int(i)] = _token_logprob(raw[j], float(raw_lse[j]), int(token_ids[i]), k)
        return SamplerOutput(token_ids=token_ids, logprobs=out)


@dataclass(frozen=True, slots=True)
class ProcessorPairs:
    """The processors any row may have (logit_bias, min_tokens, repetition, frequency/presence)
    as flat (row, token) arrays over the whole batch, on the host; None where no row has one.
    Built in one pass over the rows, for either sampler."""

    bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # rows, token ids, biases (float64)
    stop_mask: tuple[np.ndarray, np.ndarray] | None  # rows, token ids masked (min_tokens)
    # distinct (row, token) pairs of prompt + output, and the (B,) penalties (float64)
    repetition: tuple[np.ndarray, np.ndarray, np.ndarray] | None
    # distinct (row, token) pairs of the output, their counts, (B,) frequency, (B,) presence
    frequency: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], eos_token_ids: Sequence[int],
                  vocab_size: int) -> ProcessorPairs:
        """ValueError for a token id outside the vocabulary (logit_bias, stop_token_ids, the
        token history)."""
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        rep_rows: list[int] = []
        freq_rows: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_tokens.extend(p.logit_bias.keys())
                bias_values.extend(p.logit_bias.values())
            if len(row.output_token_ids) < p.min_tokens:
                stop_ids = set(p.stop_token_ids)
                if not p.ignore_eos:
                    stop_ids.update(eos_token_ids)
                mask_rows.extend([i] * len(stop_ids))
                mask_tokens.extend(stop_ids)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                freq_rows.append(i)

        bias = stop_mask = repetition = frequency = None
        if bias_rows:
            bias = (np.array(bias_rows, dtype=np.int64),
                    _checked_ids(bias_tokens, vocab_size, "logit_bias"), np.array(bias_values))
        if mask_rows:
            stop_mask = (np.array(mask_rows, dtype=np.int64),
                         _checked_ids(mask_tokens, vocab_size, "stop_token_ids"))
        if rep_rows:
            seen = [list(rows[i].prompt_token_ids) + list(rows[i].output_token_ids)
                    for i in rep_rows]
            pair_rows, pair_tokens, _ = lp.token_pairs(seen, np.array(rep_rows), vocab_size)
            penalties = np.array([r.params.repetition_penalty for r in rows])  # (B,)
            repetition = (pair_rows, pair_tokens, penalties)
        if freq_rows:
            outputs = [rows[i].output_token_ids for i in freq_rows]
            pair_rows, pair_tokens, counts = lp.token_pairs(outputs, np.array(freq_rows),
                                                            vocab_size)
            frequency = (pair_rows, pair_tokens, counts,
                         np.array([r.params.frequency_penalty for r in rows]),  # (B,)
                         np.array([r.params.presence_penalty for r in rows]))  # (B,)
        return cls(bias, stop_mask, repetition, frequency)


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


def _checked_ids(token_ids: list[int], vocab_size: int, name: str) -> np.ndarray:
    ids = np.array(token_ids, dtype=np.int64)  # (N,)
    if ids.size and ids.max() >= vocab_size:
        raise ValueError(f"{name} holds token id {int(ids.max())}, outside the vocabulary "
                         f"of size {vocab_size}")
    return ids


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

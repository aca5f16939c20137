"""SamplingBatch: a step's per-row sampling parameters as arrays on the sampler's device.

Built once per step on the host, in one pass over the rows, then one host-to-device copy per array.
Everything the sampler needs to decide which work to do (which rows are greedy, which truncate,
whether any row has a penalty) is settled here as host data, so the sampler itself never reads a
device array back to choose a branch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvcore.sampling import logits as lp
from kvcore.sampling.params import SamplingParams
from kvcore.sampling.rng import row_keys
from kvcore.sampling.rows import SamplingRow


@dataclass(frozen=True, slots=True)
class ProcessorPairs:
    """The processors any row may have (logit_bias, min_tokens, repetition, frequency/presence)
    as flat (row, token) arrays over the whole batch, on the host; None where no row has one.
    Built in one pass over the rows."""

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


def _checked_ids(token_ids: list[int], vocab_size: int, name: str) -> np.ndarray:
    ids = np.array(token_ids, dtype=np.int64)  # (N,)
    if ids.size and ids.max() >= vocab_size:
        raise ValueError(f"{name} holds token id {int(ids.max())}, outside the vocabulary "
                         f"of size {vocab_size}")
    return ids


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Device arrays are NumPy or CuPy (the sampler's `xp`); host fields are plain Python/NumPy.
    Pair arrays list distinct (row, token) pairs of the whole batch, flat."""

    num_rows: int
    vocab_size: int
    # host: the plan
    greedy: np.ndarray  # (B,) bool
    num_logprobs: tuple[int | None, ...]  # (B,) None: no logprobs; k: the chosen + top k
    max_top_k: int  # largest top_k among truncating rows (0 when none)
    any_min_p: bool
    # device: rows by kind (indices into the batch)
    greedy_rows: Any  # (G,) int64
    random_rows: Any  # (R,) int64
    truncated: Any  # (P,) int64 positions within random_rows of rows with top_k or top_p
    untruncated: Any  # (R - P,) int64 positions within random_rows of the other random rows
    logprob_rows: Any  # (W,) int64 rows that want logprobs
    # device: per random row (R,)
    temperatures: Any  # float32
    log_min_p: Any  # float64 log(min_p), -inf = off
    keys: Any  # uint64 rng keys from (seed, output position): rng.row_keys
    # device: per truncating row (P,)
    top_k: Any  # int64, vocab_size = off
    top_p: Any  # float64, 1 = off
    # device: processors over all rows, as flat (row, token) pairs; None when no row has any
    bias: tuple[Any, Any, Any] | None  # rows, tokens, float32 biases
    stop_mask: tuple[Any, Any] | None  # rows, tokens masked to -inf (min_tokens not reached)
    repetition: tuple[Any, Any, Any] | None  # pair rows, pair tokens, (B,) float32 penalties
    # pair rows, pair tokens, pair counts, (B,) float64 frequency, (B,) float64 presence
    frequency: tuple[Any, Any, Any, Any, Any] | None
    # constrained rows: (C,) int64 rows, (C, ceil(V / 32)) int32 packed token bitmasks
    token_masks: tuple[Any, Any] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy with nothing to process and no logprobs: one argmax is the answer."""
        return (bool(self.greedy.all()) and self.bias is None and self.stop_mask is None
                and self.repetition is None and self.frequency is None
                and self.token_masks is None and all(k is None for k in self.num_logprobs))

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int,
                  eos_token_ids: Sequence[int], xp: ModuleType = np) -> SamplingBatch:
        """Today's SamplingRow list -> a SamplingBatch on `xp`'s device. A random row needs
        `row.seed` (rng.make_seed, once per sequence); its output position is the number of
        tokens it generated so far, so the same (seed, position) draws the same noise."""
        num_rows = len(rows)
        params = [r.params for r in rows]
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=num_rows)  # (B,)
        seeds = np.zeros(num_rows, dtype=np.uint64)  # (B,)
        for i, row in enumerate(rows):
            if not greedy[i]:
                if row.seed is None:
                    raise ValueError(f"a random (non-greedy) row needs a seed, got None "
                                     f"(row {i})")
                seeds[i] = row.seed % 2**64
        positions = np.fromiter((len(r.output_token_ids) if r.position is None else r.position
                                 for r in rows), dtype=np.int64, count=num_rows)  # (B,)

        pairs = ProcessorPairs.from_rows(rows, eos_token_ids, vocab_size)

        def dev(array: np.ndarray) -> Any:
            return xp.asarray(array)

        bias = stop_mask = repetition = frequency = None
        if pairs.bias is not None:
            bias_rows, bias_tokens, biases = pairs.bias
            bias = (dev(bias_rows), dev(bias_tokens), dev(biases.astype(np.float32)))
        if pairs.stop_mask is not None:
            stop_mask = (dev(pairs.stop_mask[0]), dev(pairs.stop_mask[1]))
        if pairs.repetition is not None:
            pair_rows, pair_tokens, penalties = pairs.repetition
            repetition = (dev(pair_rows), dev(pair_tokens), dev(penalties.astype(np.float32)))
        if pairs.frequency is not None:
            frequency = tuple(dev(a) for a in pairs.frequency)
        masked = [(i, r.token_mask) for i, r in enumerate(rows) if r.token_mask is not None]
        token_masks = None
        if masked:
            token_masks = (dev(np.array([i for i, _ in masked], dtype=np.int64)),  # (C,)
                           dev(np.stack([m for _, m in masked])))  # (C, W) int32
        return cls(
            num_rows=num_rows, vocab_size=vocab_size, greedy=greedy,
            num_logprobs=tuple(p.logprobs for p in params),
            greedy_rows=dev(np.flatnonzero(greedy)),
            logprob_rows=dev(np.array([i for i, p in enumerate(params) if p.logprobs is not None],
                                      dtype=np.int64)),
            bias=bias, stop_mask=stop_mask, repetition=repetition, frequency=frequency,
            token_masks=token_masks,
            **_random_fields(params, greedy, seeds, positions, vocab_size, dev))


def _random_fields(params: list[SamplingParams], greedy: np.ndarray, seeds: np.ndarray,
                   positions: np.ndarray, vocab_size: int,
                   dev: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """The fields of the random rows (SamplingBatch's "per random row" and "per truncating
    row" arrays, max_top_k, any_min_p); a greedy batch gets empty arrays without more work."""
    random_rows = np.flatnonzero(~greedy)  # (R,)
    if not len(random_rows):
        empty = dev(np.zeros(0, dtype=np.int64))
        return {"random_rows": empty, "truncated": empty, "untruncated": empty,
                "temperatures": empty, "log_min_p": empty, "keys": empty, "top_k": empty,
                "top_p": empty, "max_top_k": 0, "any_min_p": False}
    rand = [params[i] for i in random_rows]
    top_k = np.array([min(p.top_k or vocab_size, vocab_size) for p in rand],
                     dtype=np.int64)  # (R,)
    top_p = np.array([p.top_p for p in rand], dtype=np.float64)  # (R,)
    cut = (top_k < vocab_size) | (top_p < 1.0)  # (R,) rows that truncate
    truncated = np.flatnonzero(cut)
    min_p = np.array([p.min_p for p in rand], dtype=np.float64)  # (R,)
    with np.errstate(divide="ignore"):
        log_min_p = np.log(min_p)  # (R,) -inf where off: no token is below l_max - inf
    return {
        "random_rows": dev(random_rows), "truncated": dev(truncated),
        "untruncated": dev(np.flatnonzero(~cut)),
        "temperatures": dev(np.array([p.temperature for p in rand], dtype=np.float32)),
        "log_min_p": dev(log_min_p),
        "keys": dev(row_keys(seeds[random_rows], positions[random_rows])),
        "top_k": dev(top_k[truncated]), "top_p": dev(top_p[truncated]),
        "max_top_k": int(top_k[cut & (top_k < vocab_size)].max(initial=0)),
        "any_min_p": bool((min_p > 0).any()),
    }

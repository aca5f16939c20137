"""The xp sampler: one batch sampler for NumPy and CuPy, drawing with counter-based Gumbel noise.

Same processors, in the same order, as vLLM v1's sampler (and the NumPy reference in tests/):
logit_bias, min_tokens, repetition, frequency/presence, then for random rows temperature, min_p,
top_k, top_p. Greedy rows take the argmax (bit for bit the reference's: the float32 ops are the
same); a random row takes argmax(logits / T + gumbel) over its kept tokens, the Gumbel-max
trick, with noise from `rng` (seed, output position, token id), so its token depends only on
its own logits, seed and position. Only token ids and the requested logprobs cross to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from kvcore.device import array_module, to_numpy
from kvcore.kernels.token_mask import apply_token_bitmask
from kvcore.sampling.params import TokenLogprob
from kvcore.sampling.rng import gumbel_, uniforms, uniforms_dense
from kvcore.sampling.rows import SamplerOutput, SamplingRow
from kvcore.sampling.xp_batch import SamplingBatch

TOP_WINDOW = 128  # first candidate window of top_k / top_p (grows x8 while too small)
# Rows of Gumbel noise made at once: keeps the (rows, V) temporaries in cache (NumPy only)
CPU_NOISE_ELEMENTS = 2**18
# Above every Gumbel value rng makes (-log(-log(1 - 2**-24)) = 16.6355), with a margin far wider
# than the ulps by which one device's log may differ from another's
NOISE_MAX = np.float32(16.64)
# The pruned draw pays ~10x per live token what the full noise pays per token: above this share
# of live tokens it stops (measured break-even ~10%: 3x faster at 0.7% live, 1.5x at 3.7%). The
# default model's logits at T = 1 / 0.8 / 0.6 leave ~26-57% / 6-16% / 1-3% live.
PRUNE_MAX_LIVE = 0.08


@dataclass(frozen=True, slots=True)
class DeviceSample:
    """The sampler's result on its device, before anything crosses to the host."""

    token_ids: Any  # (B,) int64
    chosen_logprobs: Any | None  # (W,) float64, rows batch.logprob_rows
    top_ids: Any | None  # (W, K) int64, K = the largest top-logprobs count asked; best first
    top_logprobs: Any | None  # (W, K) float64


class XpSampler:
    """Samples one token per row of (B, V) logits on the logits' own device. Logprobs are those of
    the RAW distribution (log_softmax of the unprocessed logits), vLLM's default (raw_logprobs)."""

    def __init__(self, eos_token_ids: Sequence[int], vocab_size: int, xp: ModuleType = np,
                 prune_noise: bool | None = None) -> None:
        """`prune_noise`: draw untruncated rows with noise for only the tokens that can still
        win (`_pruned_draw`, the same tokens); default on under NumPy, off under CuPy (where
        the full noise is cheap and the pruning would read a count back)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.xp = xp
        self.prune_noise = xp is np if prune_noise is None else prune_noise
        self.noise_rows = max(1, CPU_NOISE_ELEMENTS // vocab_size) if xp is np else None

    def batch(self, rows: Sequence[SamplingRow]) -> SamplingBatch:
        """SamplingBatch.from_rows on this sampler's vocabulary, EOS ids and device."""
        return SamplingBatch.from_rows(rows, self.vocab_size, self.eos_token_ids, self.xp)

    def __call__(self, logits: Any, batch: SamplingBatch) -> SamplerOutput:
        """`logits` (B, V) float32 (or float16, upcast) on the sampler's device; float32 logits
        are MODIFIED IN PLACE. Returns host token ids and per-row logprobs."""
        return self.to_host(self.sample(logits, batch), batch)

    def to_host(self, sample: DeviceSample, batch: SamplingBatch) -> SamplerOutput:
        """A DeviceSample's token ids and asked logprobs read back (waits for the device)."""
        token_ids = to_numpy(sample.token_ids).astype(np.int64, copy=False)  # (B,)
        out: list[TokenLogprob | None] = [None] * batch.num_rows
        if sample.chosen_logprobs is not None:
            chosen = to_numpy(sample.chosen_logprobs).tolist()
            top_ids = to_numpy(sample.top_ids).tolist() if sample.top_ids is not None else None
            top_lp = (to_numpy(sample.top_logprobs).tolist()
                      if sample.top_logprobs is not None else None)
            rows = [i for i, k in enumerate(batch.num_logprobs) if k is not None]
            for j, i in enumerate(rows):
                k = batch.num_logprobs[i]
                assert k is not None
                top: tuple[tuple[int, float], ...] = ()
                if k and top_ids is not None and top_lp is not None:
                    top = tuple(zip(top_ids[j][:k], top_lp[j][:k], strict=True))
                out[i] = TokenLogprob(token_id=int(token_ids[i]), logprob=chosen[j], top=top)
        return SamplerOutput(token_ids=token_ids, logprobs=out)

    def sample(self, logits: Any, batch: SamplingBatch) -> DeviceSample:
        """The whole step on the device: returns device arrays (see DeviceSample)."""
        xp = self.xp
        if (logits.ndim != 2 or logits.shape[0] != batch.num_rows
                or logits.shape[1] != self.vocab_size
                or logits.dtype not in (xp.float32, xp.float16)):
            raise ValueError(f"logits must be float32 or float16 (B={batch.num_rows}, "
                             f"V={self.vocab_size}), got {logits.dtype} {logits.shape}")
        if batch.vocab_size != self.vocab_size:
            raise ValueError(f"batch.vocab_size must be {self.vocab_size}, "
                             f"got {batch.vocab_size}")
        if batch.plain_greedy:
            return DeviceSample(logits.argmax(axis=1).astype(xp.int64), None, None, None)
        logits = logits.astype(xp.float32, copy=False)
        num_want = int(batch.logprob_rows.shape[0])
        raw = logits[batch.logprob_rows] if num_want else None  # (W, V) copy, before processing
        self._penalize(logits, batch)

        token_ids = xp.empty(batch.num_rows, dtype=xp.int64)  # (B,)
        num_greedy = int(batch.greedy_rows.shape[0])
        if num_greedy == batch.num_rows:
            token_ids[:] = logits.argmax(axis=1)
        elif num_greedy:
            token_ids[batch.greedy_rows] = logits[batch.greedy_rows].argmax(axis=1)
        if num_greedy < batch.num_rows:
            x = logits if num_greedy == 0 else logits[batch.random_rows]  # (R, V)
            token_ids[batch.random_rows] = self._draw(x, batch)
        if raw is None:
            return DeviceSample(token_ids, None, None, None)
        return DeviceSample(token_ids, *_raw_logprobs(raw, token_ids[batch.logprob_rows],
                                                      batch.num_logprobs))

    def _penalize(self, logits: Any, batch: SamplingBatch) -> None:
        """Constraint masks, logit_bias, min_tokens, repetition, frequency/presence on every
        row, in place; the same float32 arithmetic as logits.py, so greedy rows match the NumPy
        reference exactly."""
        xp = self.xp
        if batch.token_masks is not None:
            apply_token_bitmask(logits, *batch.token_masks)
        if batch.bias is not None:
            rows, tokens, values = batch.bias
            logits[rows, tokens] += values
        if batch.stop_mask is not None:
            rows, tokens = batch.stop_mask
            logits[rows, tokens] = -xp.inf
        if batch.repetition is not None:
            rows, tokens, penalties = batch.repetition
            values = logits[rows, tokens]
            penalty = penalties[rows]
            logits[rows, tokens] = xp.where(values > 0, values / penalty, values * penalty)
        if batch.frequency is not None:
            rows, tokens, counts, frequency, presence = batch.frequency
            penalty = frequency[rows] * counts + presence[rows]  # float64
            logits[rows, tokens] -= penalty.astype(xp.float32)

    def _draw(self, x: Any, batch: SamplingBatch) -> Any:
        """Random rows (R, V), processed in place: temperature, min_p, then the Gumbel-max draw,
        over the whole vocabulary or over the top_k / top_p candidates. Returns (R,) int64."""
        xp = self.xp
        x /= batch.temperatures[:, None]
        if batch.any_min_p:
            # p_j < min_p * p_max  <=>  l_j < l_max + log(min_p); -inf threshold for rows without
            threshold = x.max(axis=1).astype(xp.float64) + batch.log_min_p  # (R,)
            x[x < threshold[:, None]] = -xp.inf
        num_rows = x.shape[0]
        num_cut = int(batch.truncated.shape[0])
        token_ids = xp.empty(num_rows, dtype=xp.int64)  # (R,)
        if num_cut < num_rows:
            whole = num_cut == 0
            dense = x if whole else x[batch.untruncated]
            keys = batch.keys if whole else batch.keys[batch.untruncated]
            token_ids[batch.untruncated] = self._untruncated_draw(dense, keys)
        if num_cut:
            whole = num_cut == num_rows
            cut = x if whole else x[batch.truncated]
            keys = batch.keys if whole else batch.keys[batch.truncated]
            token_ids[batch.truncated] = _truncated_draw(cut, keys, batch.top_k, batch.top_p,
                                                         batch.max_top_k)
        return token_ids

    def _untruncated_draw(self, x: Any, keys: Any) -> Any:
        """argmax(x + gumbel) over every token of rows (U, V); (U,) int64. On the CPU a few rows
        at a time, so the noise's temporaries stay in cache, each chunk pruned when it can be."""
        xp = self.xp
        num_rows = x.shape[0]
        step = self.noise_rows or num_rows
        token_ids = xp.empty(num_rows, dtype=xp.int64)  # (U,)
        for start in range(0, num_rows, step):
            part, part_keys = x[start:start + step], keys[start:start + step]
            drawn = _pruned_draw(part, part_keys) if self.prune_noise else None
            token_ids[start:start + step] = _dense_draw(part, part_keys) if drawn is None \
                else drawn
        return token_ids


def _dense_draw(x: Any, keys: Any) -> Any:
    """argmax(x + gumbel) of rows (U, V) with the noise of every token; (U,) int64."""
    noise = gumbel_(uniforms_dense(keys, x.shape[1]))  # (U, V)
    noise += x
    return noise.argmax(axis=1)


def _pruned_draw(x: Any, keys: Any, max_live: float = PRUNE_MAX_LIVE) -> Any | None:
    """argmax(x + gumbel) of rows (U, V), with noise only where it can matter: the noise lies
    below NOISE_MAX, so once the row's top token scores s = x_top + g_top, a token with
    x + NOISE_MAX < s can never win. The same token as the full noise (float32 addition is
    monotone, ties go to the lowest id in both); works in place on `x`. (U,) int64, or None
    (x untouched) when more than `max_live` of the tokens can still win: then the full noise
    is cheaper (its hash makes two tokens at a time)."""
    xp = array_module(x)
    num_rows, vocab_size = x.shape
    top = x.argmax(axis=1)  # (U,)
    best = x[xp.arange(num_rows), top] + gumbel_(uniforms(keys, top[:, None]))[:, 0]  # (U,)
    # flat indices: one 1-D nonzero is several times faster than a 2-D one in NumPy
    live = xp.flatnonzero(x + NOISE_MAX >= best[:, None])  # (L,) the tokens that can still win
    if live.shape[0] > max_live * x.size:
        return None
    live_rows = live // vocab_size
    flat = x.reshape(-1)  # (U * V,) a view when x is contiguous, else a copy: used alike
    scores = flat[live] + gumbel_(uniforms(keys[live_rows], (live - live_rows * vocab_size)
                                           [:, None]))[:, 0]  # (L,)
    flat.fill(-xp.inf)
    flat[live] = scores
    return flat.reshape(num_rows, vocab_size).argmax(axis=1)


def _truncated_draw(x: Any, keys: Any, top_k: Any, top_p: Any, max_top_k: int,
                    window: int = TOP_WINDOW) -> Any:
    """top_k, then top_p (vLLM semantics, as logits.apply_top_k / apply_top_p), then the draw,
    all among each row's `size` largest logits (P, V) -> (P,) int64, never a full sort unless a
    row's kept set is as wide as the vocabulary. Candidates are ordered by logit descending, then
    token id, so ties resolve the same on every device. A row is resolved once its window holds
    every token tied with its k-th (top_k) or its first dropped token (top_p alone); the window
    grows x8 for the others."""
    xp = array_module(x)
    num_rows, vocab_size = x.shape
    token_ids = xp.empty(num_rows, dtype=xp.int64)  # (P,)
    peak = x.max(axis=1, keepdims=True)  # (P, 1)
    # float64 sums: a float32 running sum over a large vocabulary drifts by ~V * eps at the cut
    total = xp.exp(x - peak).sum(axis=1, dtype=xp.float64)  # (P,) unnormalized mass
    pending = xp.arange(num_rows)  # rows of x still to resolve
    num_pending = num_rows
    size = min(max(window, max_top_k), vocab_size)
    while num_pending:
        sub = x if num_pending == num_rows else x[pending]  # (N, V)
        if size < vocab_size:
            cand = xp.sort(xp.argpartition(-sub, size - 1, axis=1)[:, :size], axis=1)
        else:
            cand = xp.broadcast_to(xp.arange(vocab_size), sub.shape)  # (N, V) already by id
        vals = xp.take_along_axis(sub, cand, axis=1)  # (N, size)
        order = _stable_argsort(-vals)  # by logit, then (stable) token id
        cand = xp.take_along_axis(cand, order, axis=1)
        vals = xp.take_along_axis(vals, order, axis=1)
        rows = xp.arange(num_pending)
        k = top_k[pending]  # (N,), vocab_size = off
        kth = vals[rows, xp.minimum(k, size) - 1]  # (N,)
        keep = vals >= kth[:, None]  # (N, size) top_k, ties with the k-th kept
        k_on = k < vocab_size
        probs = xp.exp(vals.astype(xp.float64) - peak[pending]) * keep  # (N, size)
        # top_k's set lies inside a resolved window, so its mass is the window's kept mass
        mass = xp.where(k_on, probs.sum(axis=1), total[pending])  # (N,)
        above = (xp.cumsum(probs, axis=1) - probs) / mass[:, None]
        p = top_p[pending][:, None]  # (N, 1), 1 = off: then no rounding of `above` may drop one
        num_keep = xp.maximum((keep & ((above < p) | (p >= 1.0))).sum(axis=1), 1)  # (N,)
        keep &= xp.arange(size) < num_keep[:, None]
        # past a -inf window edge every other token is -inf too: nothing left to find
        settled = (vals[:, -1] == -xp.inf) | (size == vocab_size)  # (N,)
        done = xp.where(k_on, (vals[:, -1] < kth) | settled, (num_keep < size) | settled)
        all_done = bool(done.all())  # the one sync per window
        idx = rows if all_done else xp.flatnonzero(done)
        if all_done or idx.shape[0]:
            c, v, kept = (cand, vals, keep) if all_done else (cand[idx], vals[idx], keep[idx])
            noise = gumbel_(uniforms(keys[pending[idx]], c))  # (D, size)
            score = xp.where(kept, v + noise, -xp.inf)
            token_ids[pending[idx]] = xp.take_along_axis(
                c, score.argmax(axis=1)[:, None], axis=1)[:, 0]
        if all_done:
            break
        pending = pending[~done]
        num_pending = int(pending.shape[0])
        size = min(size * 8, vocab_size)
    return token_ids


def _raw_logprobs(raw: Any, chosen: Any, num_logprobs: tuple[int | None, ...]
                  ) -> tuple[Any, Any | None, Any | None]:
    """Raw logprobs of rows (W, V): the chosen tokens' (W,) and the K best (W, K) ids and
    logprobs, by logprob descending then token id; logprob = logit - logsumexp, float64."""
    xp = array_module(raw)
    peak = raw.max(axis=1, keepdims=True)  # (W, 1)
    lse = peak[:, 0].astype(xp.float64) + xp.log(xp.exp(raw - peak).sum(axis=1, dtype=xp.float64))
    rows = xp.arange(raw.shape[0])
    chosen_lp = raw[rows, chosen].astype(xp.float64) - lse  # (W,)
    k = min(max(n for n in num_logprobs if n is not None), raw.shape[1])
    if k == 0:
        return chosen_lp, None, None
    if k < raw.shape[1]:
        top = xp.sort(xp.argpartition(-raw, k - 1, axis=1)[:, :k], axis=1)  # (W, k) by id
    else:
        top = xp.broadcast_to(xp.arange(k), raw.shape)
    vals = xp.take_along_axis(raw, top, axis=1)
    order = _stable_argsort(-vals)
    top = xp.take_along_axis(top, order, axis=1)
    top_lp = xp.take_along_axis(vals, order, axis=1).astype(xp.float64) - lse[:, None]
    return chosen_lp, top, top_lp


def _stable_argsort(a: Any) -> Any:
    """Row-wise stable argsort of (N, M): NumPy needs kind="stable"; CuPy's sort is always
    stable (and older versions refuse the keyword)."""
    if isinstance(a, np.ndarray):
        return np.argsort(a, axis=1, kind="stable")
    return array_module(a).argsort(a, axis=1)

"""Beam search scoring, step for step the same as transformers 5.x `_beam_search`.

Per step, with `gen_len` = tokens each candidate holds after this step (the prompt not counted):
1. Candidates: the top K = max(2, 1 + num_stop_ids) * beam_width of cum_logprob[beam] +
   logprob[beam, token] over all (live beam, token) pairs, in float32 (as transformers).
2. A candidate "hits" if its token is a stop id (EOS unless ignore_eos, or a stop_token_id) or if
   gen_len == max_tokens (then every candidate hits).
3. Survivors (the next live beams): the first beam_width candidates that do not hit, best first.
4. Among the first beam_width candidates only, those that hit become finished hypotheses with
   score = cum_logprob / gen_len ** length_penalty, where gen_len counts the generated tokens
   INCLUDING the final EOS (transformers: cur_len + 1 - decoder_prompt_len). The container keeps
   the best beam_width of them.
5. Done when every candidate hit (max_tokens), or the container is full and either
   early_stopping is True, or the best survivor's cum_logprob / best_len ** length_penalty is not
   above the worst finished score, where best_len = max_tokens if early_stopping == "never" and
   length_penalty > 0, else gen_len (transformers' `_check_early_stop_heuristic` after
   `cur_len += 1`).
Ties between equal scores are broken by (beam, token) order; torch.topk leaves them unspecified.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from kvcore.device import array_module, to_numpy
from kvcore.sampling.params import BeamSearchParams


@dataclass(frozen=True, slots=True)
class BeamCandidate:
    parent: int  # index of the live beam it extends, in the order the logprob rows were given
    token_id: int
    cum_logprob: float  # the parent's cum_logprob + this token's logprob (float32 arithmetic)


@dataclass(frozen=True, slots=True)
class BeamHypothesis:
    token_ids: tuple[int, ...]  # generated tokens, the final EOS / stop token included
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty


@dataclass(frozen=True, slots=True)
class BeamStep:
    # the next live beams, best first; several may share a parent (fork its blocks) and a
    # previous beam that is no parent is dropped (free its blocks)
    survivors: list[BeamCandidate]
    finished: list[BeamHypothesis]  # hypotheses that entered the finished set this step
    done: bool  # the search is over: free every live beam, read results()


def top_candidates(cum_logprobs: np.ndarray, logprobs: np.ndarray,
                   num_candidates: int) -> list[BeamCandidate]:
    """The best `num_candidates` (beam, token) continuations, best first.

    cum_logprobs (L,) and logprobs (L, V) are taken as float32, as transformers adds them.
    `logprobs` may live on the GPU (CuPy): the scores and the partition stay there, and only the
    k candidates' indices and scores come to the host to be ordered."""
    num_beams, vocab_size = logprobs.shape
    if cum_logprobs.shape != (num_beams,):
        raise ValueError(f"cum_logprobs must have shape ({num_beams},), got {cum_logprobs.shape}")
    xp = array_module(logprobs)
    cum = xp.asarray(np.asarray(cum_logprobs, dtype=np.float32))  # (L,) on logprobs' device
    scores = (logprobs.astype(xp.float32) + cum[:, None]).ravel()  # (L * V,)
    k = min(num_candidates, scores.size)
    part = xp.argpartition(-scores, k - 1)[:k]  # (k,) the best k, unordered
    best = to_numpy(part).astype(np.int64)  # (k,) host
    best_scores = to_numpy(scores[part])  # (k,) host float32
    order = np.lexsort((best, -best_scores))  # score descending, then (beam, token)
    # a continuation of probability 0 (a token a constraint masks out) is no candidate
    return [BeamCandidate(parent=int(best[j] // vocab_size), token_id=int(best[j] % vocab_size),
                          cum_logprob=float(best_scores[j])) for j in order
            if best_scores[j] > -np.inf]


def length_penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, rounded as torch does (float32 / float32)."""
    return float(np.float32(cum_logprob) / np.float32(length ** length_penalty))


class BeamHypotheses:
    """The best `beam_width` finished hypotheses, best first."""

    def __init__(self, beam_width: int) -> None:
        self.beam_width = beam_width
        self._hyps: list[BeamHypothesis] = []

    def add(self, hyp: BeamHypothesis) -> bool:
        """Insert `hyp` if it is among the best beam_width; on a tie the older one ranks first."""
        keys = [-h.score for h in self._hyps]
        pos = bisect.bisect_right(keys, -hyp.score)
        if pos >= self.beam_width:
            return False
        self._hyps.insert(pos, hyp)
        del self._hyps[self.beam_width:]
        return True

    @property
    def is_full(self) -> bool:
        return len(self._hyps) >= self.beam_width

    @property
    def worst_score(self) -> float:
        return self._hyps[-1].score if self._hyps else -np.inf

    @property
    def hypotheses(self) -> list[BeamHypothesis]:
        return list(self._hyps)

    def __len__(self) -> int:
        return len(self._hyps)


class BeamSearch:
    """One request's beam search. Starts with one live beam (the prompt); call step() with the
    log-softmax rows of the live beams (in `live` order) until it returns done."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: Collection[int],
                 max_tokens: int | None = None) -> None:
        """`max_tokens`: the resolved limit when params.max_tokens is None (the context's room)."""
        self.params = params
        max_tokens = max_tokens or params.max_tokens
        assert max_tokens is not None, "a beam search needs its resolved max_tokens"
        self.max_tokens: int = max_tokens
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        self.stop_ids = frozenset(eos) | frozenset(params.stop_token_ids)
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * params.beam_width
        # live beams: (generated token ids, cum_logprob as float32)
        self.live: list[tuple[tuple[int, ...], float]] = [((), 0.0)]
        self.finished = BeamHypotheses(params.beam_width)
        self.num_generated = 0
        self.done = False

    def step(self, logprobs: np.ndarray) -> BeamStep:
        """`logprobs` (L, V): log-softmax of each live beam's next-token logits."""
        if self.done:
            raise RuntimeError("beam search is already done")
        if logprobs.ndim != 2 or logprobs.shape[0] != len(self.live):
            raise ValueError(f"logprobs must have one row per live beam ({len(self.live)}), "
                             f"got shape {logprobs.shape}")
        p = self.params
        gen_len = self.num_generated + 1
        at_max = gen_len >= self.max_tokens
        cum = np.array([score for _, score in self.live], dtype=np.float32)  # (L,)
        candidates = top_candidates(cum, logprobs, self.num_candidates)
        hits = [at_max or c.token_id in self.stop_ids for c in candidates]

        finished: list[BeamHypothesis] = []
        for cand, hit in zip(candidates[:p.beam_width], hits[:p.beam_width], strict=True):
            if hit:
                hyp = BeamHypothesis(
                    token_ids=self.live[cand.parent][0] + (cand.token_id,),
                    cum_logprob=cand.cum_logprob,
                    score=length_penalized(cand.cum_logprob, gen_len, p.length_penalty))
                if self.finished.add(hyp):
                    finished.append(hyp)
        survivors = [c for c, hit in zip(candidates, hits, strict=True) if not hit][:p.beam_width]
        self.live = [(self.live[c.parent][0] + (c.token_id,), c.cum_logprob) for c in survivors]
        self.num_generated = gen_len
        self.done = not survivors or self._is_done(survivors[0].cum_logprob, gen_len)
        if self.done:
            self.live = []
        return BeamStep(survivors=survivors if not self.done else [], finished=finished,
                        done=self.done)

    def _is_done(self, best_running: float, gen_len: int) -> bool:
        p = self.params
        if not self.finished.is_full:
            return False
        if p.early_stopping is True:
            return True
        never = p.early_stopping == "never" and p.length_penalty > 0
        best_len = self.max_tokens if never else gen_len
        best_possible = length_penalized(best_running, best_len, p.length_penalty)
        return not best_possible > self.finished.worst_score

    def results(self) -> list[BeamHypothesis]:
        """The finished hypotheses, best first (beam_width of them once the search is done)."""
        return self.finished.hypotheses

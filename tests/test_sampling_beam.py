"""Beam search scoring: candidates vs brute force, a hand-computed search, and a NumPy
transliteration of transformers 5.x's masked-tensor algorithm on a bigram "model"."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvcore.sampling import (
    BeamHypotheses,
    BeamHypothesis,
    BeamSearch,
    BeamSearchParams,
    top_candidates,
)
from kvcore.sampling.logits import log_softmax


@pytest.mark.parametrize("seed", range(5))
def test_top_candidates_match_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_beams, vocab = int(rng.integers(1, 5)), 30
    logprobs = rng.standard_normal((num_beams, vocab)).astype(np.float32)  # (L, V)
    cum = rng.uniform(-10, 0, size=num_beams).astype(np.float32)  # (L,)
    everything = sorted(((float(np.float32(cum[b] + logprobs[b, t])), b, t)
                         for b in range(num_beams) for t in range(vocab)),
                        key=lambda c: (-c[0], c[1], c[2]))
    for k in (1, 4, 8, num_beams * vocab + 3):
        got = [(c.cum_logprob, c.parent, c.token_id) for c in top_candidates(cum, logprobs, k)]
        assert got == everything[:k]


def test_hypotheses_keep_the_best_beam_width() -> None:
    hyps = BeamHypotheses(2)
    assert not hyps.is_full and hyps.worst_score == -np.inf
    assert hyps.add(BeamHypothesis((1,), -1.0, -1.0))
    assert hyps.add(BeamHypothesis((2,), -3.0, -3.0))
    assert hyps.is_full and hyps.worst_score == -3.0
    assert not hyps.add(BeamHypothesis((3,), -4.0, -4.0))
    assert not hyps.add(BeamHypothesis((4,), -3.0, -3.0))  # a tie does not displace the older
    assert hyps.add(BeamHypothesis((5,), -0.5, -0.5))
    assert [h.token_ids for h in hyps.hypotheses] == [(5,), (1,)]


def hand_search(early_stopping: bool | str) -> tuple[BeamSearch, list[list[tuple[int, int]]]]:
    """beam_width 2, EOS 3, max_tokens 3, length_penalty 1, with these rows (see the asserts)."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=3,
                                         early_stopping=early_stopping), eos_token_ids=[3])
    rows = [
        [[-1.0, -0.5, -3.0, -0.7]],
        [[-0.2, -2.0, -2.5, -0.3], [-0.1, -3.0, -3.0, -2.0]],
        [[-0.6, -1.0, -1.5, -2.0], [-0.05, -3.0, -3.0, -3.0]],
    ]
    moves = []
    for row in rows:
        step = search.step(np.array(row, dtype=np.float32))
        moves.append([(c.parent, c.token_id) for c in step.survivors])
        if step.done:
            break
    return search, moves


def test_hand_computed_search() -> None:
    search, moves = hand_search(False)
    # step 1: EOS (-0.7) is among the top 2, finishes with score -0.7; survivors tokens 1 and 0
    # step 2: beam 0 + EOS = -0.8 finishes (score -0.8 / 2 = -0.4): the set is full; best
    #         running -0.7 / 2 = -0.35 > worst finished -0.7, so the search goes on
    # step 3: max_tokens: the top 2 candidates finish: (0,0,0) -1.15 / 3 and (1,0,0) -1.3 / 3
    assert moves == [[(0, 1), (0, 0)], [(0, 0), (1, 0)], []]
    assert search.done
    got = [(h.token_ids, h.cum_logprob, h.score) for h in search.results()]
    want = [((0, 0, 0), -1.15, -1.15 / 3), ((1, 3), -0.8, -0.4)]
    for (ids, cum, score), (want_ids, want_cum, want_score) in zip(got, want, strict=True):
        assert ids == want_ids
        assert cum == pytest.approx(want_cum, abs=1e-6)
        assert score == pytest.approx(want_score, abs=1e-6)


def test_hand_computed_early_stopping_true_stops_when_full() -> None:
    search, moves = hand_search(True)
    assert len(moves) == 2 and moves[-1] == [] and search.done
    assert [h.token_ids for h in search.results()] == [(1, 3), (3,)]


def test_candidates_cover_every_stop_id() -> None:
    """With 2 stop ids the 4 best continuations may all be stops: transformers keeps
    (1 + num_eos) * beam_width = 6 candidates, so 2 beams still survive."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=3.0,
                                         early_stopping="never"), eos_token_ids=[1, 2])
    assert search.num_candidates == 6
    first = search.step(np.array([[-3.0, -0.1, -0.2, -2.5, -2.6]], dtype=np.float32))
    assert [(c.parent, c.token_id) for c in first.survivors] == [(0, 3), (0, 4)]
    assert [h.token_ids for h in first.finished] == [(1,), (2,)]
    second = search.step(np.array([[-5.0, -0.01, -0.02, -6.0, -6.0],
                                   [-5.0, -0.03, -0.04, -6.0, -6.0]], dtype=np.float32))
    assert [(c.parent, c.token_id) for c in second.survivors] == [(0, 0), (1, 0)]
    assert second.finished == [] and not second.done  # (3, 1) scores -2.51 / 8, below -0.2


def test_step_after_done_and_bad_rows_raise() -> None:
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=1), eos_token_ids=[0])
    with pytest.raises(ValueError, match="one row per live beam"):
        search.step(np.zeros((2, 5), dtype=np.float32))
    assert search.step(np.log(np.full((1, 5), 0.2, dtype=np.float32))).done
    with pytest.raises(RuntimeError, match="already done"):
        search.step(np.zeros((1, 5), dtype=np.float32))


def transformers_like(table: np.ndarray, prompt_last: int, num_beams: int, max_new: int,
                      length_penalty: float, early_stopping: bool | str,
                      eos: list[int]) -> list[tuple[tuple[int, ...], float]]:
    """transformers 5.x `_beam_search` for one prompt, transliterated to NumPy with the same
    fixed-size running/finished arrays and -1e9 masks (batch of 1, bigram model)."""
    vocab = table.shape[0]
    keep = max(2, 1 + len(eos)) * num_beams
    running_seq = np.full((num_beams, max_new), -1)
    running_scores = np.full(num_beams, -1e9, dtype=np.float32)
    running_scores[0] = 0.0
    seqs = np.full((num_beams, max_new), -1)
    scores = np.full(num_beams, -1e9, dtype=np.float32)
    finished = np.zeros(num_beams, dtype=bool)
    for cur in range(max_new):  # cur = generated tokens so far
        last = running_seq[:, cur - 1] if cur else np.full(num_beams, prompt_last)
        logp = log_softmax(table[last]).astype(np.float32) + running_scores[:, None]
        flat = logp.reshape(-1)
        order = np.lexsort((np.arange(flat.size), -flat))[:keep]
        top_scores = flat[order]
        top_seq = running_seq[order // vocab].copy()
        top_seq[:, cur] = order % vocab
        hits = np.isin(order % vocab, eos) | (cur + 1 >= max_new)
        masked = top_scores + hits.astype(np.float32) * np.float32(-1e9)
        nxt = np.lexsort((np.arange(keep), -masked))[:num_beams]
        running_seq, running_scores = top_seq[nxt], masked[nxt]
        just = hits & (np.arange(keep) < num_beams)
        cand = top_scores / np.float32((cur + 1) ** length_penalty)
        cand = cand + (~just).astype(np.float32) * np.float32(-1e9)
        merged = np.concatenate([scores, cand])
        pick = np.lexsort((np.arange(merged.size), -merged))[:num_beams]
        seqs = np.concatenate([seqs, top_seq])[pick]
        finished = np.concatenate([finished, just])[pick]
        scores = merged[pick]
        if hits.all():
            break
        never = early_stopping == "never" and length_penalty > 0.0
        best_len = max_new if never else cur + 1
        best = running_scores[0] / np.float32(best_len ** length_penalty)
        worst = scores.min() if finished.all() else np.float32(-1e9)
        if not best > worst or (finished.all() and early_stopping is True):
            break
    return [(tuple(int(t) for t in s[s >= 0]), float(v)) for s, v in zip(seqs, scores, strict=True)
            if v > -1e8]


def bigram_table(seed: int, vocab: int, eos: list[int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((vocab, vocab)) * 2.0).astype(np.float32)  # (V, V)
    for e in eos:  # EOS fairly likely, so hypotheses finish at different lengths
        table[:, e] += rng.uniform(-1.0, 3.0, size=vocab).astype(np.float32)
    return table


def run_beam_search(table: np.ndarray, prompt_last: int, params: BeamSearchParams,
                    eos: list[int]) -> list[tuple[tuple[int, ...], float]]:
    search = BeamSearch(params, eos)
    last = [prompt_last]
    while not search.done:
        step = search.step(log_softmax(table[last]).astype(np.float32))
        last = [c.token_id for c in step.survivors]
    return [(h.token_ids, h.score) for h in search.results()]


CASES = list(itertools.product([2, 3, 4], [1.0, 0.0, 1.7, -0.6], [False, True, "never"]))


@pytest.mark.parametrize(("beam_width", "length_penalty", "early_stopping"), CASES)
def test_full_search_matches_transformers_transliteration(
        beam_width: int, length_penalty: float, early_stopping: bool | str) -> None:
    for seed in range(10):
        eos = [1] if seed % 3 else [1, 7]
        table = bigram_table(seed, vocab=24, eos=eos)
        params = BeamSearchParams(beam_width=beam_width, max_tokens=12,
                                  length_penalty=length_penalty, early_stopping=early_stopping)
        got = run_beam_search(table, 5, params, eos)
        want = transformers_like(table, 5, beam_width, 12, length_penalty, early_stopping, eos)
        assert [ids for ids, _ in got] == [ids for ids, _ in want], f"seed {seed}"
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-6)

"""The engine's beam policy: when a request's beams are ready to be scored, and what it decides."""

from __future__ import annotations

import numpy as np

from kvcore.engine.beam import BeamPolicy
from kvcore.request import Sequence
from kvcore.sampling import BeamSearch, BeamSearchParams

VOCAB = 8


def _beam(seq_id: str) -> Sequence:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    seq = Sequence(seq_id=seq_id, request_id="r", prompt_token_ids=[5, 6, 7], params=params,
                   max_tokens=4)
    seq.num_computed_tokens = seq.num_tokens  # its K/V is complete: its row is current
    return seq


def test_a_preempted_beam_is_not_ready_until_its_row_is_recomputed() -> None:
    policy = BeamPolicy(BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4), [2]))
    a, b = _beam("a"), _beam("b")
    policy.rows["a"] = np.zeros(VOCAB, np.float32)
    assert not policy.ready([a, b])  # b has no row yet
    policy.rows["b"] = np.zeros(VOCAB, np.float32)
    assert policy.ready([a, b])
    b.num_computed_tokens = 0  # preempted after its row came: recomputed before it counts
    assert not policy.ready([a, b])
    b.num_computed_tokens = b.num_tokens  # its recompute ends with a new row for b
    policy.rows["b"] = np.zeros(VOCAB, np.float32)
    assert policy.ready([a, b])


def test_decide_extends_the_best_rows_and_forks_a_parent_taken_twice() -> None:
    policy = BeamPolicy(BeamSearch(BeamSearchParams(beam_width=2, max_tokens=4,
                                                    ignore_eos=True), [2]))
    row = np.full(VOCAB, -10.0, np.float32)
    row[[3, 4]] = [2.0, 1.0]  # one live beam (the prompt): its two best tokens both survive
    policy.rows["a"] = row
    decision = policy.decide(["a"])
    assert decision.results is None and decision.dropped == []
    assert [(m.parent, m.token_id, m.fork) for m in decision.moves] == [(0, 3, False),
                                                                       (0, 4, True)]
    assert policy.rows == {}  # every row is used once

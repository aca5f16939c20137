"""The int4 window operations batched into launches: consecutive seals and copies merge while
they cannot see each other's writes, in order; the window_slot table is written once."""

from __future__ import annotations

from kvcore.cache.int4_window import ASSIGN, COPY, RELEASE, SEAL, STEP_SEAL, batch_window_ops


def test_runs_merge_until_a_hazard() -> None:
    ops = [(ASSIGN, 5, 0), (SEAL, 3, 1), (SEAL, 4, 2),  # one seal launch
           (COPY, 0, 1), (COPY, 0, 2),  # one copy launch: distinct destinations
           (COPY, 2, 3),  # reads slot 2, which the previous copy writes: a new launch
           (SEAL, 3, 4), (SEAL, 3, 5),  # block 3 sealed twice: the second after the first
           (RELEASE, 5, 0), (ASSIGN, 6, 0), (STEP_SEAL, 6, 0)]
    stages, table, step_seals = batch_window_ops(ops)
    assert stages == [(SEAL, [(3, 1), (4, 2)]), (COPY, [(0, 1), (0, 2)]), (COPY, [(2, 3)]),
                      (SEAL, [(3, 4)]), (SEAL, [(3, 5)])]
    assert table == {5: -1, 3: -1, 4: -1, 6: 0}
    assert step_seals == [(6, 0)]  # for the step's forward, after its writes


def test_a_copy_onto_a_source_or_destination_waits() -> None:
    stages, _, _ = batch_window_ops([(COPY, 0, 1), (COPY, 2, 0), (COPY, 3, 4), (COPY, 5, 4)])
    assert stages == [(COPY, [(0, 1)]), (COPY, [(2, 0), (3, 4)]), (COPY, [(5, 4)])]
    assert batch_window_ops([]) == ([], {}, [])

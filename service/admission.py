"""Admission against `--max-waiting`: a call's sequences are reserved the moment it is admitted.

The engine learns of a call's requests only when its generation tasks first run, so calls that
arrive together would all see the same empty queue. Instead each admitted call reserves its
sequences (prompts x n, beams) synchronously, before any await, and gives them back as its
engine requests end. What waits is then what the engine reports waiting, or the reserved
sequences it does not run (those not yet added included), whichever is larger.
"""

from __future__ import annotations

from typing import Any

from kvcore.service.errors import APIError


class Admission:
    """The server's reservations. Single-threaded: used on the event loop only."""

    def __init__(self, max_waiting: int | None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.max_waiting = max_waiting  # None: never 429
        self.num_reserved = 0  # sequences of admitted calls whose engine requests have not ended

    def num_waiting(self, engine: Any) -> int:
        """Sequences that wait: the engine's count, or the reserved ones it does not run."""
        stats = engine.stats()
        running = stats.num_running if stats is not None else 0
        return max(engine.num_waiting, self.num_reserved - running)

    def admit(self, engine: Any, num_seqs: int) -> Reservation:
        """Reserve a call's `num_seqs` sequences, or 429 unless they fit the waiting queue whole.
        A call bigger than the whole queue is let into an empty one (else it could never run)."""
        limit = self.max_waiting
        if limit is not None:
            waiting = self.num_waiting(engine)
            if waiting + num_seqs > limit and (waiting > 0 or limit == 0):
                raise APIError(429, f"the server's waiting queue is full ({waiting} of {limit} "
                               f"sequences wait; this call brings {num_seqs}); retry later",
                               headers={"Retry-After": "1"})
        self.num_reserved += num_seqs
        return Reservation(self, num_seqs)


class Reservation:
    """One call's reserved sequences; released per engine request as each ends, the rest when
    the call ends (whichever way)."""

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self._admission = admission
        self.num_seqs = num_seqs

    def release(self, num_seqs: int) -> None:
        num = min(num_seqs, self.num_seqs)
        self.num_seqs -= num
        self._admission.num_reserved -= num

    def close(self) -> None:
        self.release(self.num_seqs)

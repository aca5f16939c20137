"""When speculation pays: a per-sequence acceptance estimate against the measured cost of a
draft row, and a doubling backoff for sequences whose drafts keep being rejected.

A step over B decoding sequences emits B tokens in time t0(B). A draft token at position j of
a sequence whose drafts are accepted token by token with probability p adds p^j expected
tokens (it counts only when every earlier one was accepted) and one row, which costs
`row_cost * t0(B)`. It is worth its row when p^j > B * row_cost: a sequence drafts the
longest run of such positions (up to k), none when even the first is not worth it. The
threshold B * row_cost is at most MAX_THRESHOLD: a step stalled by something else (another
process, a collection) must not turn speculation off for good.
"""

from __future__ import annotations

from typing import Any

PRIOR_ACCEPTED = 2.0  # a sequence's acceptance estimate starts at 2 / 3 (a prior of 3 trials)
PRIOR_TRIALS = 3.0
DECAY = 0.7  # weight of a sequence's older verifying steps against its latest
MISSES_BEFORE_BACKOFF = 2  # verifying steps in a row with no draft token accepted
FIRST_BACKOFF_STEPS = 8  # then no drafts for this many steps, doubled at every further miss
MAX_BACKOFF_STEPS = 128
DEFAULT_ROW_COST = 0.25  # a draft row / a one-row step until measured (B rows: / B)
MAX_THRESHOLD = 0.5
COST_WEIGHT = 0.2  # of the latest step in the measured averages
MAX_ROW_COST = 1.0  # a draft row costing more than a whole step: stalled by something else
OUTLIER = 3.0  # a step without drafts this many times the average: idle or stalled, not timed


class SeqState:
    """A sequence's acceptance evidence (accepted draft tokens out of the positions tried,
    decayed) and its backoff."""

    __slots__ = ("seq", "accepted", "trials", "misses", "backoff", "resume_step", "probe")

    def __init__(self, seq: Any) -> None:
        self.seq = seq
        self.accepted = 0.0
        self.trials = 0.0
        self.misses = 0
        self.backoff = FIRST_BACKOFF_STEPS
        self.resume_step = 0  # no drafts before this step
        self.probe = False  # the next draft is one token, whatever the estimate

    @property
    def acceptance(self) -> float:
        return (self.accepted + PRIOR_ACCEPTED) / (self.trials + PRIOR_TRIALS)

    def num_draft(self, k: int, threshold: float, step: int) -> int:
        """Draft tokens worth verifying now (0: none; then backed off when nothing is)."""
        if step < self.resume_step:
            return 0
        if self.probe:
            return 1
        p = self.acceptance
        num = 0
        gain = p
        while num < k and gain > threshold:
            num += 1
            gain *= p
        if num == 0:
            self.back_off(step)
        return num

    def back_off(self, step: int) -> None:
        """No drafts for the next `backoff` steps, then a one-token probe."""
        self.resume_step = step + self.backoff + 1
        self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
        self.misses = 0
        self.probe = True

    def update(self, num_draft: int, num_accepted: int, step: int) -> None:
        """A verifying step: positions tried are the accepted ones and the first rejected."""
        tried = num_accepted + (num_accepted < num_draft)
        self.accepted = DECAY * self.accepted + num_accepted
        self.trials = DECAY * self.trials + tried
        was_probe, self.probe = self.probe, False
        if num_accepted:
            self.misses = 0
            self.backoff = FIRST_BACKOFF_STEPS
            return
        self.misses += 1
        if was_probe or self.misses >= MISSES_BEFORE_BACKOFF:
            self.back_off(step)


class StepCost:
    """The cost of a draft row relative to a step of the same batch without drafts, learnt
    from the time between consecutive steps (one `observe` per step, before it is scheduled):
    per batch size B, an average of the steps without drafts, and of what each draft row of
    the others added to it. Steps that prefilled (or may have: requests were waiting) do not
    count, nor do outliers: the time from a batch's last step to the next one includes
    whatever the engine did meanwhile (idle, other work)."""

    def __init__(self) -> None:
        self.base: dict[int, float] = {}  # B -> seconds of a step without drafts
        self.row_cost: dict[int, float] = {}  # B -> a draft row's seconds / base[B]
        self._last: tuple[float, int, int, bool] | None = None  # time, B, draft rows, clean

    def cost(self, batch: int) -> float:
        return self.row_cost.get(batch, DEFAULT_ROW_COST / max(batch, 1))

    def threshold(self, batch: int) -> float:
        """What a draft position's acceptance probability must exceed to be worth its row."""
        return min(batch * self.cost(batch), MAX_THRESHOLD)

    def observe(self, now: float, batch: int, num_draft_rows: int, clean: bool) -> None:
        """A step starts at `now` with `batch` decoding sequences and this many draft rows;
        `clean`: nothing else (prefill, admission) runs in it. Times the previous step."""
        last, self._last = self._last, (now, batch, num_draft_rows, clean)
        if last is None or not last[3]:
            return
        start, b, rows, _ = last
        seconds = now - start
        old = self.base.get(b)
        if rows == 0:
            if old is None:
                self.base[b] = seconds
            elif seconds <= OUTLIER * old:
                self.base[b] = COST_WEIGHT * seconds + (1 - COST_WEIGHT) * old
            return
        if old is None or old <= 0:
            return
        sample = max((seconds / old - 1) / rows, 0.0)
        if sample <= MAX_ROW_COST:
            self.row_cost[b] = COST_WEIGHT * sample + (1 - COST_WEIGHT) * self.cost(b)

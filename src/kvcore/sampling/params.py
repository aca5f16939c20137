"""Validated sampling and beam-search parameters and the per-token logprob record."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from kvcore.config import ParamError
from kvcore.sampling.constraints import Constraint

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_BEAM_WIDTH = 128
# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# near-zero temperature only produces overflow, never a different argmax.
GREEDY_TEMPERATURE_EPS = 1e-5
# Ranges where the math stays finite in float32 (logits of a real model are within about +-1e3):
# a repetition penalty divides positive logits by it (1e-38 overflowed them to inf and broke the
# draw), and a beam's score divides by length ** length_penalty (1000 overflowed at any length;
# +-5 keeps 131,072 ** 5 = 3.8e25 and its inverse inside float32's normal range).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LENGTH_PENALTY_RANGE = (-5.0, 5.0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    if not _is_int(value) or value < low or (high is not None and value > high):
        raise ParamError(name, f"{name} must be an integer {bound}, got {value!r}")


def _check_float(name: str, value: Any, low: float, high: float, *, open_low: bool = False) -> None:
    try:  # an int too large for a float overflows in isfinite
        ok = _is_number(value) and math.isfinite(value) and value <= high
    except OverflowError:
        ok = False
    ok = ok and (value > low if open_low else value >= low)
    if not ok:
        interval = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ParamError(name, f"{name} must be a finite number in {interval}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ParamError(name, f"{name} must be a bool, got {value!r}")


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ParamError(name, f"{name} must be a sequence of token ids, got {value!r}")
    ids = tuple(value)
    for token_id in ids:
        if not _is_int(token_id) or token_id < 0:
            raise ParamError(name, f"{name} must hold token ids >= 0, got {token_id!r}")
    return ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None = off
    min_p: float = 0.0
    seed: int | None = None  # a per-request generator: same seed, same output, whatever the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output: what the text must match
    # derived once (read per row per step): argmax decoding, no randomness, so no generator
    greedy: bool = field(init=False, repr=False, compare=False)
    # a processor reads the sequence's tokens (min_tokens, repetition / frequency / presence
    # penalties): the sampler needs its history, not only its output position
    reads_history: bool = field(init=False, repr=False, compare=False)
    # greedy with no processor (no logit_bias, nothing reading the history): the token is the
    # raw logits' argmax (logprobs, if asked, are of the raw logits too)
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, open_low=True)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ParamError("logit_bias", f"logit_bias must be a mapping token id -> bias, "
                                 f"got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                if not _is_int(token_id) or token_id < 0:
                    raise ParamError("logit_bias", f"logit_bias keys must be token ids >= 0, "
                                                   f"got {token_id!r}")
                _check_float("logit_bias", bias, -100.0, 100.0)
            # a private copy, so a caller mutating its dict cannot change a running request
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids",
                                                              self.stop_token_ids))
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_constraint(self.constraint)
        greedy = self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1
        reads_history = (self.min_tokens > 0 or self.repetition_penalty != 1.0
                         or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)
        object.__setattr__(self, "greedy", greedy)
        object.__setattr__(self, "reads_history", reads_history)
        object.__setattr__(self, "argmax_only", greedy and not self.logit_bias
                           and not reads_history and self.constraint is None)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once (its n choices)."""
        return self.n


def _check_constraint(value: Any) -> None:
    if value is not None and not isinstance(value, Constraint):
        raise ParamError("constraint", f"constraint must be a Constraint or None, got {value!r}")


def _stop_strings(value: Any) -> tuple[str, ...]:
    # OpenAI accepts a single string as well as a list; a bare str must not be split into chars
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, Iterable):
        raise ParamError("stop", f"stop must be a sequence of strings, got {value!r}")
    stops = tuple(stops)
    if len(stops) > MAX_STOP_STRINGS:
        raise ParamError("stop", f"stop must hold at most {MAX_STOP_STRINGS} strings, "
                                 f"got {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise ParamError("stop", f"stop strings must be non-empty strings, got {stop!r}")
    return stops


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int | None = 16  # None: until max_model_len (as SamplingParams)
    length_penalty: float = 1.0
    # as transformers: True stops as soon as beam_width hypotheses are finished; False stops when
    # the best running beam, scored at its current length, cannot beat the worst finished one;
    # "never" does the same but (for length_penalty > 0) scores the running beam at max_tokens.
    early_stopping: bool | Literal["never"] = False
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    constraint: Constraint | None = None
    # SamplingParams' fields a beam search does not take, at their defaults, so the engine reads
    # either params alike: beams are scored on the host from their logits rows
    min_tokens: ClassVar[int] = 0
    logprobs: ClassVar[None] = None
    logit_bias: ClassVar[None] = None
    seed: ClassVar[None] = None
    greedy: ClassVar[bool] = True  # no random draws

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_float("length_penalty", self.length_penalty, *LENGTH_PENALTY_RANGE)
        if self.early_stopping not in (True, False, "never") or not isinstance(
                self.early_stopping, bool | str):
            raise ParamError("early_stopping", f"early_stopping must be True, False or 'never', "
                             f"got {self.early_stopping!r}")
        _check_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids",
                                                              self.stop_token_ids))
        _check_constraint(self.constraint)

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once (its beams)."""
        return self.beam_width


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first, len = params.logprobs

"""Structured-output constraints: a JSON schema, regex, choice or grammar compiled by llguidance
into one matcher per sequence, and the token bitmasks of a step's constrained rows."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from kvcore.config import ParamError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema / regex / grammar longer than this is refused unread
MAX_CHOICES = 1024
COMPILE_CACHE_SIZE = 256  # compiled grammars kept per tokenizer (LRU)
# llguidance's own bounds on a grammar's compile work (its defaults, spelled out: ~20 ms of
# regex analysis, 500k grammar symbols) and on one mask computation: beyond them the compile
# fails with llguidance's message (a 400), never a stalled engine
INITIAL_LEXER_FUEL = 1_000_000
MAX_GRAMMAR_SIZE = 500_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
# JSON without optional whitespace: an unsure model cannot spend max_tokens on blanks
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
MASK_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. `spec`: the JSON schema as JSON text, the
    regex, the choices as a JSON array, or the Lark-like grammar; "" for json_object. `param`
    names the request field it came from (errors carry it); it is not part of the identity."""

    kind: str
    spec: str = ""
    param: str = field(default="constraint", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ParamError(self.param, f"constraint kind must be one of {KINDS}, "
                                         f"got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ParamError(self.param, f"{self.param} must be text, got {self.spec!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ParamError(self.param, f"{self.param} is {len(self.spec)} characters, more "
                                         f"than the {MAX_SPEC_CHARS} allowed")
        if self.kind != "json_object" and not self.spec:
            raise ParamError(self.param, f"{self.param} must not be empty")

    @classmethod
    def json_schema(cls, schema: Any, param: str = "constraint") -> Constraint:
        if not isinstance(schema, dict):
            raise ParamError(param, f"{param} must be a JSON schema object, got {schema!r}")
        # key order kept: llguidance writes properties in the schema's order
        return cls("json_schema", json.dumps(schema), param)

    @classmethod
    def choice(cls, options: Any, param: str = "constraint") -> Constraint:
        if (not isinstance(options, list | tuple) or not options
                or len(options) > MAX_CHOICES
                or not all(isinstance(o, str) and o for o in options)):
            raise ParamError(param, f"{param} must be 1 to {MAX_CHOICES} non-empty strings, "
                                    f"got {options!r}")
        return cls("choice", json.dumps(list(options)), param)

    def grammar(self) -> str:
        """The llguidance grammar text (ParamError when the spec cannot be one)."""
        matcher = llguidance.LLMatcher
        if self.kind == "json_schema" or self.kind == "json_object":
            try:
                return matcher.grammar_from_json_schema(self.spec or '{"type": "object"}',
                                                        overrides=JSON_OPTIONS)  # type: ignore
            except ValueError as e:
                raise ParamError(self.param, f"{self.param}: invalid JSON schema: {e}") from None
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            options = " | ".join(json.dumps(o) for o in json.loads(self.spec))
            return matcher.grammar_from_lark(f"start: {options}")
        return matcher.grammar_from_lark(self.spec)


class SeqMatcher:
    """One sequence's position in its constraint, advanced by each token it appends. With async
    scheduling the mask worker may advance it by a token before the engine appends that token:
    `consume_at` takes each output position once, whichever thread comes first."""

    __slots__ = ("matcher", "num_tokens", "stopped", "_lock")

    def __init__(self, matcher: llguidance.LLMatcher, num_tokens: int = 0) -> None:
        self.matcher = matcher
        self.num_tokens = num_tokens  # output tokens consumed
        # as of num_tokens; kept here: a second consume_at must not touch the matcher, which
        # the mask worker may be filling from
        self.stopped = bool(matcher.is_stopped())
        self._lock = threading.Lock()

    def consume(self, token_id: int) -> bool:
        """Advance by the next token; True when the constraint is complete and nothing but its
        end may follow (the sequence ends "stop"). ValueError: the token was refused."""
        return self.consume_at(self.num_tokens, token_id)

    def consume_at(self, position: int, token_id: int) -> bool:
        """consume() of output token `position`, unless it was consumed already."""
        with self._lock:
            if position > self.num_tokens:
                raise ValueError(f"token position {position} skips {self.num_tokens}")
            if position == self.num_tokens:
                if not self.matcher.consume_token(token_id):
                    raise ValueError(f"token {token_id} violates the constraint: "
                                     f"{self.matcher.get_error()}")
                self.num_tokens += 1
                self.stopped = bool(self.matcher.is_stopped())
            return self.stopped

    def rollback(self, num_tokens: int) -> None:
        with self._lock:
            if not self.matcher.rollback(num_tokens):
                raise ValueError(f"cannot roll back {num_tokens} tokens: "
                                 f"{self.matcher.get_error()}")
            self.num_tokens -= num_tokens
            self.stopped = bool(self.matcher.is_stopped())

    def fork(self) -> SeqMatcher:
        with self._lock:
            return SeqMatcher(self.matcher.deep_copy(), self.num_tokens)


class ConstraintCompiler:
    """Compiles constraints for one tokenizer, with a bounded LRU of compiled grammars (a hit
    costs a matcher copy). Thread-safe. `tokenizer_json` gives the tokenizer.json text when
    the first constraint needs it."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int], cache_size: int = COMPILE_CACHE_SIZE,
                 max_grammar_size: int = MAX_GRAMMAR_SIZE) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL, max_grammar_size=max_grammar_size,
            step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (0.3 s for 49k tokens)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab_size,
                    eos_token=self._eos or None)
            return self._tokenizer

    def matcher(self, constraint: Constraint) -> SeqMatcher:
        """A fresh matcher at the constraint's start (ParamError with llguidance's message when
        it does not compile)."""
        key = (constraint.kind, constraint.spec)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return SeqMatcher(template.deep_copy())
        tokenizer = self.tokenizer
        grammar = constraint.grammar()
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise ParamError(constraint.param, f"{constraint.param}: "
                                               f"{template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return SeqMatcher(template.deep_copy())


class MaskTimes:
    """A histogram of the seconds each step's mask computation took (host data, read by the
    service's metrics at scrape time)."""

    def __init__(self, buckets: tuple[float, ...] = MASK_TIME_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket
        self.total = 0.0

    def snapshot(self) -> tuple[tuple[float, ...], tuple[int, ...], float]:
        """(bucket upper edges, counts per bucket + one above all, sum of seconds)."""
        return self.buckets, tuple(self.counts), self.total

    def observe(self, seconds: float) -> None:
        i = next((i for i, edge in enumerate(self.buckets) if seconds <= edge), len(self.buckets))
        self.counts[i] += 1
        self.total += seconds


class MaskFiller:
    """Fills the token bitmasks of a step's constrained rows, (C, ceil(V / 32)) int32, in a
    worker thread while the forward pass runs: llguidance fills the rows in parallel without
    the GIL."""

    def __init__(self, vocab_size: int, num_threads: int | None = None) -> None:
        self.num_words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor(num_threads)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvcore-mask")
        self.times = MaskTimes()

    def fill(self, matchers: Sequence[SeqMatcher]) -> np.ndarray:
        start = time.perf_counter()
        masks = np.empty((len(matchers), self.num_words), dtype=np.int32)  # (C, W)
        fill_next_token_bitmask_par(self._executor,
                                    [(m.matcher, i) for i, m in enumerate(matchers)], masks)
        self.times.observe(time.perf_counter() - start)
        return masks

    def submit(self, job: Callable[[], np.ndarray]) -> Future[np.ndarray]:
        """Run `job` (which calls fill) in the mask worker, in submission order."""
        return self._worker.submit(job)

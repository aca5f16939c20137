"""Structured-output constraints: a JSON schema, regex, choice or grammar, compiled by llguidance
(after kvcore.grammar bounded it and a worker process compiled it first) into one matcher per
sequence."""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import llguidance

from kvcore.config import ParamError
from kvcore.grammar.cache import CACHE_BYTES, TENANT_SHARE, Compiled, CompiledCache
from kvcore.grammar.native import (
    JSON_OPTIONS,
    KINDS,
    MAX_GRAMMAR_SIZE,
    MAX_SPEC_CHARS,
    CompileThreads,
    build,
    grammar_text,
    make_tokenizer,
    parser_limits,
)
from kvcore.grammar.pool import COMPILE_TIMEOUT_S, NUM_WORKERS, CompilePool

__all__ = ["JSON_OPTIONS", "KINDS", "MAX_SPEC_CHARS", "Compiled", "Constraint",
           "ConstraintCompiler", "SeqMatcher"]

MAX_CHOICES = 1024
DEFAULT_TENANT = "default"


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
        return grammar_text(self.kind, self.spec, self.param)


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
    """Compiles constraints for one tokenizer; thread-safe. A constraint is compiled once per
    cache salt (tenants never share compiled grammars, as they never share KV blocks): in a
    worker process first (kvcore.grammar.pool: bounds, time and memory limits, a crash costs
    one request), then here on a big-stack compile thread, and kept in a byte-bounded cache
    (kvcore.grammar.cache). `tokenizer_json` gives the tokenizer.json text when the first
    constraint needs it."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int], *, cache_bytes: int = CACHE_BYTES,
                 tenant_share: float = TENANT_SHARE, num_workers: int = NUM_WORKERS,
                 timeout_s: float = COMPILE_TIMEOUT_S,
                 max_grammar_size: int = MAX_GRAMMAR_SIZE,
                 pool: CompilePool | None = None) -> None:
        self._tokenizer_json = tokenizer_json
        self._json_text: str | None = None
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self.cache = CompiledCache(cache_bytes, tenant_share)
        self.pool = pool if pool is not None else CompilePool(
            self._tokenizer_text, vocab_size, self._eos, num_workers=num_workers,
            timeout_s=timeout_s, max_grammar_size=max_grammar_size)
        self._threads: CompileThreads | None = None
        self._num_threads = self.pool.num_workers
        self._limits = parser_limits(max_grammar_size)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        # the worker processes end with this compiler (or at exit)
        self._finalizer = weakref.finalize(self, self.pool.close)

    def _tokenizer_text(self) -> str:
        """The tokenizer.json text, serialized once (each worker's start reads it)."""
        with self._lock:
            if self._json_text is None:
                self._json_text = self._tokenizer_json()
            return self._json_text

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use or by warm() (0.3 s for
        49k tokens, holding the GIL)."""
        text = self._tokenizer_text()
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = make_tokenizer(text, self.vocab_size, self._eos)
            return self._tokenizer

    def warm(self) -> None:
        """Build what the first compile would otherwise build while requests are served: the
        tokenizer's JSON text and llguidance's tokenizer (both hold the GIL: a stall of every
        stream if they ran mid-serving). The worker processes start on first use."""
        _ = self.tokenizer

    @staticmethod
    def key(constraint: Constraint, cache_salt: str | None) -> Hashable:
        return cache_salt, constraint.kind, constraint.spec

    def lookup(self, constraint: Constraint, cache_salt: str | None = None) -> Compiled | None:
        """The compiled constraint if it is cached (or held by a running request)."""
        return self.cache.get(self.key(constraint, cache_salt))

    def submit(self, constraint: Constraint, tenant: str = DEFAULT_TENANT,
               cache_salt: str | None = None) -> Future[Compiled]:
        """compile() on a compile thread (for callers that must not block)."""
        with self._lock:
            if self._threads is None:
                self._threads = CompileThreads(self._num_threads)
                weakref.finalize(self, self._threads.close)
            threads = self._threads
        return threads.submit(lambda: self._compile(constraint, tenant, cache_salt))

    def compile(self, constraint: Constraint, tenant: str = DEFAULT_TENANT,
                cache_salt: str | None = None) -> Compiled:
        """The compiled constraint, from the cache or compiled now (blocking: the worker, then
        a compile thread). ParamError naming the field when it is refused."""
        compiled = self.lookup(constraint, cache_salt)
        return compiled if compiled is not None else (
            self.submit(constraint, tenant, cache_salt).result())

    def _compile(self, constraint: Constraint, tenant: str,
                 cache_salt: str | None) -> Compiled:
        key = self.key(constraint, cache_salt)
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        verdict = self.pool.check(constraint.kind, constraint.spec, constraint.param)
        # the same input, the same code and stack size as in the worker that just survived it
        # (its pure-Python bounds included: not run again here, where they would hold the GIL)
        built = build(self.tokenizer, constraint.kind, constraint.spec, constraint.param,
                      self._limits, shape_checked=True)
        compiled = Compiled(key, built.template, verdict.num_bytes, tenant)
        self.cache.put(compiled)
        return compiled

    def matcher(self, constraint: Constraint, cache_salt: str | None = None) -> SeqMatcher:
        """A fresh matcher at the constraint's start: a copy of the cached template (compiled
        first when it is not cached: the synchronous path)."""
        return SeqMatcher(self.compile(constraint, cache_salt=cache_salt).template.deep_copy())

    def close(self) -> None:
        """End the worker processes and compile threads (also done when collected)."""
        self._finalizer()
        if self._threads is not None:
            self._threads.close()

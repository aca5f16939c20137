"""The one way a constraint reaches llguidance's native code: its shape checked in pure Python
(kvcore.grammar.bounds), then compiled on a thread whose stack holds any recursion the bounds
and the size limit allow, its first token mask computed there too. The compile worker process
and the server run this same code on the same stack size, so a worker that survives an input
proves the server survives it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from kvcore.config import ParamError
from kvcore.grammar.bounds import check_literal, check_regex
from kvcore.grammar.lark_shape import check_lark
from kvcore.grammar.schema_shape import check_schema

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema / regex / grammar longer than this is refused unread
# The compile threads' stack. Measured: native compile recursion takes 3.4 KB per $ref link,
# 7.7 KB per $ref'd array and 3.1 KB per Lark rule of a chain, so the longest chain a
# MAX_SPEC_CHARS spec can spell (~19,000 one-letter Lark rules, ~10,500 $refs) needs at most
# ~60 MB; 256 MiB also compiles the chains at 10x the crash lengths (30,000 $refs, 20,000
# arrays, 30,000 rules) before any bound. Only touched pages are resident.
COMPILE_STACK_BYTES = 256 << 20
# llguidance's bounds on one grammar's compile work (its defaults, spelled out: ~20 ms of
# regex analysis, 500k grammar symbols) and on one mask computation: beyond them the compile
# fails with llguidance's message (a 400), never a stalled engine
INITIAL_LEXER_FUEL = 1_000_000
MAX_GRAMMAR_SIZE = 500_000
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_LEXER_STATES = 50_000  # lexer states a matcher may build lazily (~1-2 KB each)
# JSON without optional whitespace: an unsure model cannot spend max_tokens on blanks
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
COMPILE_NICE = 5  # compile threads and worker processes yield the cores to the engine
T = TypeVar("T")


def check_shape(kind: str, spec: str, param: str) -> None:
    """The pure-Python bounds of a constraint (ParamError naming `param`)."""
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except (ValueError, RecursionError) as e:
            raise ParamError(param, f"{param}: invalid JSON schema: {e}") from None
        check_schema(schema, param)
    elif kind == "regex":
        check_regex(spec, param)
    elif kind == "choice":
        for option in json.loads(spec):
            check_literal(option, param, "a choice")
    elif kind == "grammar":
        check_lark(spec, param)


def grammar_text(kind: str, spec: str, param: str) -> str:
    """The llguidance grammar of a constraint (ParamError when the spec cannot be one)."""
    matcher = llguidance.LLMatcher
    if kind in ("json_schema", "json_object"):
        try:
            return matcher.grammar_from_json_schema(spec or '{"type": "object"}',
                                                    overrides=JSON_OPTIONS)  # type: ignore
        except ValueError as e:
            raise ParamError(param, f"{param}: invalid JSON schema: {e}") from None
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        options = " | ".join(json.dumps(o) for o in json.loads(spec))
        return matcher.grammar_from_lark(f"start: {options}")
    return matcher.grammar_from_lark(spec)


def parser_limits(max_grammar_size: int = MAX_GRAMMAR_SIZE) -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        initial_lexer_fuel=INITIAL_LEXER_FUEL, max_grammar_size=max_grammar_size,
        step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES)


@dataclass(frozen=True, slots=True)
class Built:
    """A compiled constraint: the template matcher every sequence copies, and what its build
    measured (heap bytes: where the caller measures them)."""

    template: llguidance.LLMatcher
    compile_seconds: float  # wall
    mask_seconds: float  # CPU seconds of the first token mask


def build(tokenizer: llguidance.LLTokenizer, kind: str, spec: str, param: str,
          limits: llguidance.LLParserLimits, *, shape_checked: bool = False) -> Built:
    """Bounds (unless a worker checked this very input), compile and the first mask (on a
    copy: the lexer states it builds are shared with the template, so the engine's first step
    finds them). ParamError on refusal. Run it on a CompileThreads thread."""
    if not shape_checked:
        check_shape(kind, spec, param)
    grammar = grammar_text(kind, spec, param)
    start = time.perf_counter()
    template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    compiled = time.perf_counter()
    if template.is_error():
        raise ParamError(param, f"{param}: {template.get_error()}")
    probe = template.deep_copy()
    mask = np.zeros((1, (tokenizer.vocab_size + 31) // 32), dtype=np.int32)  # (1, W)
    mask_start = time.thread_time()  # CPU seconds of this thread: not a busy machine's wait
    fill_next_token_bitmask(probe, mask, 0)
    mask_seconds = time.thread_time() - mask_start
    if probe.is_error():
        raise ParamError(param, f"{param}: {probe.get_error()}")
    if not mask.any() and not probe.is_accepting():
        raise ParamError(param, f"{param}: no token can start an answer to this constraint")
    return Built(template, compiled - start, mask_seconds)


class CompileThreads:
    """`num_threads` threads with COMPILE_STACK_BYTES stacks, started at once (the stack size
    is fixed when a thread starts), running submitted calls in order."""

    _stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore

    def __init__(self, num_threads: int, stack_bytes: int = COMPILE_STACK_BYTES,
                 name: str = "kvcore-compile", nice: int = COMPILE_NICE) -> None:
        self._nice = nice
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._threads = []
        with self._stack_lock:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(num_threads):
                    thread = threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def _run(self) -> None:
        if self._nice and hasattr(os, "setpriority"):
            # Linux: a thread's own niceness (its id names it): compiles yield the cores to the
            # engine's threads and the event loop
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while (job := self._jobs.get()) is not None:
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller, whatever it is
                future.set_exception(e)
            del job, fn, future  # the result is the caller's alone (a cache entry's lifetime)


def heap_bytes() -> int:
    """Bytes the C heap holds (glibc's mallinfo2: in-use chunks plus mmapped blocks), where
    llguidance's Rust allocations live; the resident set size where mallinfo2 is missing."""
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        return int(info.uordblks + info.hblkhd)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = _MallInfo2
    return fn  # type: ignore[no-any-return]


_MALLINFO2 = _mallinfo2()


def make_tokenizer(tokenizer_json: str, vocab_size: int,
                   eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary (0.3 s for 49k tokens)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids) or None)

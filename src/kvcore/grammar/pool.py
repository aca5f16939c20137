"""The server's side of the compile worker processes (kvcore.grammar.worker): each untrusted
constraint is compiled in a worker first, under a time and an address-space limit. A worker that
crashes or runs over its time is killed and replaced; its request gets a 400 naming the field.
Thread-safe: a caller blocks until a worker is free, then until its answer or the deadline."""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import kvcore
from kvcore.config import ParamError
from kvcore.grammar.native import COMPILE_NICE, COMPILE_STACK_BYTES, MAX_GRAMMAR_SIZE
from kvcore.grammar.worker import read_frame, write_frame

NUM_WORKERS = 2
# a compile (and its first mask) over this many seconds of the worker's CPU is a 400: CPU time,
# so a busy machine does not refuse what an idle one compiles; the wall clock's backstop is
# WALL_FACTOR times as long
COMPILE_TIMEOUT_S = 10.0
WALL_FACTOR = 6.0
_POLL_S = 0.1  # how often a waiting caller reads the worker's CPU time
WORKER_MEMORY_BYTES = 2 << 30  # address space a worker may add beyond its start-up size
STARTUP_TIMEOUT_S = 120.0  # importing llguidance and building its tokenizer


class CompilerUnavailable(RuntimeError):
    """No compile worker could start (the server's fault, not the request's: a 503)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """A worker's measurements of a constraint it compiled."""

    num_bytes: int  # heap the compiled grammar held after its first mask
    compile_seconds: float
    mask_seconds: float


@dataclass(slots=True)
class PoolStats:
    num_compiles: int = 0
    num_refused: int = 0  # 400s: bounds, llguidance's errors, over a limit
    num_crashes: int = 0  # workers that died on an input
    num_timeouts: int = 0  # workers killed at the deadline


class _Worker:
    def __init__(self, setup: dict[str, Any]) -> None:
        env = dict(os.environ)
        # the worker imports kvcore.grammar from wherever this process found kvcore
        root = os.path.dirname(os.path.dirname(os.path.abspath(kvcore.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        # one malloc arena: the heap then grows only by new mappings, which RLIMIT_AS counts
        # (a per-thread arena reserves 64 MiB up front, which it would not)
        env["MALLOC_ARENA_MAX"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcore.grammar.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.ended = False  # its output ended: it died
        write_frame(self.stdin, setup)
        if self.answer(STARTUP_TIMEOUT_S) is None:
            self.kill()
            raise RuntimeError(f"no answer within {STARTUP_TIMEOUT_S:g} s")

    def answer(self, timeout: float, cpu_limit: float | None = None) -> dict[str, Any] | None:
        """The next frame, or None when the worker died, the deadline passed or it spent more
        than `cpu_limit` seconds of CPU meanwhile."""
        deadline = time.monotonic() + timeout
        cpu_start = self.cpu_seconds()
        fd = self.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, _POLL_S))
            if ready:
                frame = read_frame(self.stdout)
                self.ended = frame is None
                return frame
            if cpu_limit is not None and cpu_start is not None:
                used = self.cpu_seconds()
                if used is not None and used - cpu_start > cpu_limit:
                    return None

    def cpu_seconds(self) -> float | None:
        """The worker's user + system CPU time (None where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.stdin.close()
        self.stdout.close()

    def close(self) -> None:
        try:
            self.stdin.close()  # the worker ends at the end of its input
            self.proc.wait(timeout=2)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.stdout.close()


class CompilePool:
    """`num_workers` worker processes, started on first use."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int,
                 eos_token_ids: Sequence[int], *, num_workers: int = NUM_WORKERS,
                 timeout_s: float = COMPILE_TIMEOUT_S,
                 memory_bytes: int = WORKER_MEMORY_BYTES,
                 stack_bytes: int = COMPILE_STACK_BYTES,
                 max_grammar_size: int = MAX_GRAMMAR_SIZE) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._tokenizer_json = tokenizer_json
        self._setup: dict[str, Any] = {
            "vocab_size": vocab_size, "eos": list(eos_token_ids), "stack_bytes": stack_bytes,
            "memory_bytes": memory_bytes, "max_grammar_size": max_grammar_size,
            "nice": COMPILE_NICE}
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.stats = PoolStats()
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(None)  # a slot: its worker starts when first needed
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()

    def check(self, kind: str, spec: str, param: str) -> Verdict:
        """Compile in a worker: its measurements, or ParamError naming `param` (a refusal, a
        crash, or past the time limit)."""
        worker = self._idle.get()
        if worker is None:
            worker = self._start()
        try:
            write_frame(worker.stdin, {"kind": kind, "spec": spec, "param": param})
            reply = worker.answer(self.timeout_s * WALL_FACTOR, self.timeout_s)
        except (OSError, ValueError):  # the pipe broke: the worker died
            reply = None
            worker.ended = True
        if reply is None:
            self._lost(worker, param)
        self._idle.put(worker)
        with self._lock:
            self.stats.num_compiles += 1
            if not reply["ok"]:
                self.stats.num_refused += 1
                raise ParamError(param, reply["error"])
        return Verdict(reply["num_bytes"], reply["compile_seconds"], reply["mask_seconds"])

    def _start(self) -> _Worker:
        """A new worker for a free slot (CompilerUnavailable, the slot freed, if it fails)."""
        try:
            worker = _Worker({**self._setup, "tokenizer_json": self._tokenizer_json()})
        except (OSError, ValueError, RuntimeError) as e:
            self._idle.put(None)
            raise CompilerUnavailable(f"the constraint compile worker did not start: "
                                      f"{type(e).__name__}: {e}") from None
        except BaseException:
            self._idle.put(None)
            raise
        with self._lock:
            self._all.add(worker)
        return worker

    def _lost(self, worker: _Worker, param: str) -> NoReturn:
        """A worker that crashed or ran past the deadline: killed, its slot freed for a new
        one, and the request's 400."""
        self._idle.put(None)
        timed_out = not worker.ended
        if not timed_out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)  # its exit status names the crash
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            if timed_out:
                self.stats.num_timeouts += 1
            else:
                self.stats.num_crashes += 1
        if timed_out:
            raise ParamError(param, f"{param}: compiling the constraint took longer than "
                                    f"{self.timeout_s:g} s of CPU")
        code = worker.proc.returncode
        how = f"exit status {code}"
        if code < 0:
            how = f"signal {_signal_name(-code)}"
        raise ParamError(param, f"{param}: the constraint crashed the compiler ({how}); it "
                                "is too deep or too large to compile")

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, set()
        for worker in workers:
            worker.close()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)

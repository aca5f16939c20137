"""The compile worker process (`python -m kvcore.grammar.worker`): compiles each constraint the
server sends it, exactly as the server would (kvcore.grammar.native.build), under an address
space limit, and answers what it measured or why it refused. A crash here costs one request;
the server starts another worker. Frames on stdin / stdout: a 4-byte big-endian length, then
JSON."""

from __future__ import annotations

import json
import os
import resource
import struct
import sys
from functools import partial
from typing import IO, Any

from kvcore.config import ParamError
from kvcore.grammar.native import CompileThreads, build, heap_bytes, make_tokenizer, parser_limits

# a compiled constraint may hold at most this much of the heap (grammar, lexer, first mask)
MAX_ENTRY_BYTES = 64 << 20
# its first token mask may take at most this much CPU time (the engine waits for masks)
MAX_FIRST_MASK_S = 0.5


def write_frame(out: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    out.write(struct.pack(">I", len(data)) + data)
    out.flush()


def read_frame(inp: IO[bytes]) -> dict[str, Any] | None:
    """The next frame (None at the end of input: the server went away)."""
    head = inp.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    data = inp.read(size)
    if len(data) < size:
        return None
    message: dict[str, Any] = json.loads(data)
    return message


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def serve(inp: IO[bytes], out: IO[bytes]) -> None:
    setup = read_frame(inp)
    if setup is None:
        return
    tokenizer = make_tokenizer(setup["tokenizer_json"], setup["vocab_size"], setup["eos"])
    limits = parser_limits(setup["max_grammar_size"])
    os.nice(setup["nice"])  # the engine's threads win the cores over a compile
    threads = CompileThreads(1, setup["stack_bytes"], name="kvcore-compile-worker", nice=0)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file behind
    if setup["memory_bytes"]:  # the limit counts from what the worker holds once started
        limit = _vm_bytes() + setup["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, {"ready": True})
    while (job := read_frame(inp)) is not None:
        write_frame(out, threads.submit(partial(_compile, tokenizer, limits, job)).result())


def _compile(tokenizer: Any, limits: Any, job: dict[str, Any]) -> dict[str, Any]:
    param = job["param"]
    before = heap_bytes()
    try:
        built = build(tokenizer, job["kind"], job["spec"], param, limits)
    except ParamError as e:
        return {"ok": False, "error": str(e)}
    except MemoryError:
        return {"ok": False, "error": f"{param}: compiling it needs more memory than a "
                                      "constraint may use"}
    num_bytes = max(heap_bytes() - before, 0)
    compile_seconds, mask_seconds = built.compile_seconds, built.mask_seconds
    del built  # frees the grammar: the worker keeps nothing between jobs
    if num_bytes > MAX_ENTRY_BYTES:
        return {"ok": False, "error": f"{param}: the compiled constraint holds "
                                      f"{num_bytes >> 20} MiB, more than the "
                                      f"{MAX_ENTRY_BYTES >> 20} MiB one may hold"}
    if mask_seconds > MAX_FIRST_MASK_S:
        return {"ok": False, "error": f"{param}: its first token mask took "
                                      f"{mask_seconds:.2f} s of CPU, more than "
                                      f"{MAX_FIRST_MASK_S} s"}
    return {"ok": True, "num_bytes": num_bytes, "compile_seconds": compile_seconds,
            "mask_seconds": mask_seconds}


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)

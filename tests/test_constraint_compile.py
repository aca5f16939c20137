"""Where constraints compile: a worker process that may crash, run out of time or memory at the
cost of one 400; big-stack compile threads that survive the crash shapes at 10x the lengths that
killed the server (while a default 8 MiB thread dies on them); matching that does not recurse;
a cache bounded in bytes with per-tenant shares; and AsyncEngine.prepare, where tenants take
turns at the workers."""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from engine_helpers import make_engine
from kvcore.config import ParamError
from kvcore.engine import AsyncEngine
from kvcore.grammar.cache import Compiled, CompiledCache
from kvcore.grammar.pool import CompilePool, CompilerUnavailable
from kvcore.model.tokenizer import Tokenizer
from kvcore.sampling.constraints import Constraint, ConstraintCompiler

TOOLS = Path(__file__).parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
from soak_constraints import alternation, schema_chain  # noqa: E402


def _pool(model_dir: Path, **kwargs: Any) -> CompilePool:
    tokenizer = Tokenizer.from_dir(model_dir)
    return CompilePool(tokenizer.to_json, 259, [tokenizer.eos_token_id or 0], num_workers=1,
                       **kwargs)


def _refusal(pool: CompilePool, kind: str, spec: str) -> str:
    with pytest.raises(ParamError) as info:
        pool.check(kind, spec, "field")
    assert info.value.param == "field" and str(info.value).startswith("field: ")
    return str(info.value)


def test_a_worker_crash_costs_one_request_and_the_worker_is_replaced(
        tiny_model_dir: Path) -> None:
    """A worker whose compile stack is 256 KiB dies on a 100-link $ref chain (inside every
    bound): that request is a 400 naming its field, the next compiles in a new worker."""
    pool = _pool(tiny_model_dir, stack_bytes=256 << 10)
    try:
        chain = json.dumps(schema_chain(100))
        assert "crashed the compiler (signal SIGSEGV)" in _refusal(pool, "json_schema", chain)
        assert pool.check("regex", "a+b", "field").num_bytes > 0
        assert "crashed" in _refusal(pool, "json_schema", chain)
        assert pool.check("json_schema", '{"type": "integer"}', "field").compile_seconds >= 0
        assert (pool.stats.num_crashes, pool.stats.num_compiles) == (2, 2)
    finally:
        pool.close()


def test_a_compile_past_its_time_or_memory_is_a_400(tiny_model_dir: Path) -> None:
    grammar = alternation(20_000)
    slow = _pool(tiny_model_dir, timeout_s=0.05)
    small = _pool(tiny_model_dir, memory_bytes=16 << 20)  # the grammar needs ~35 MiB
    try:
        assert "took longer than 0.05 s of CPU" in _refusal(slow, "grammar", grammar)
        assert slow.stats.num_timeouts == 1
        slow.timeout_s = 60.0
        assert slow.check("grammar", 'start: "x"', "field").num_bytes > 0  # a new worker
        # past its address space: a MemoryError the worker reports, or an allocation failure
        # that aborts it (SIGABRT; it is replaced)
        message = _refusal(small, "grammar", grammar)
        assert "more memory than a constraint may use" in message or "SIGABRT" in message
        assert small.check("regex", "a+", "field").num_bytes >= 0
    finally:
        slow.close()
        small.close()


def test_a_worker_that_cannot_start_is_the_servers_fault_not_the_requests() -> None:
    pool = CompilePool(lambda: "not a tokenizer", 259, [0], num_workers=1)
    for _ in range(2):  # its slot is free again: the next call tries a new worker
        with pytest.raises(CompilerUnavailable, match="did not start"):
            pool.check("regex", "a+", "field")
    pool.close()


_PROOF = textwrap.dedent('''
    import json, sys, threading
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from llguidance.numpy import fill_next_token_bitmask
    from kvcore.config import ParamError
    from kvcore.grammar.native import CompileThreads, build, make_tokenizer, parser_limits
    from soak_constraints import array_chain, grammar_chain, schema_chain
    tokenizer = make_tokenizer(open(sys.argv[3]).read(), 259, [0])
    shapes = {"schema_chain": ("json_schema", json.dumps(schema_chain(30_000))),
              "array_chain": ("json_schema", json.dumps(array_chain(20_000))),
              "grammar_chain": ("grammar", grammar_chain(30_000))}
    def compile(kind, spec):  # bounds skipped: native code meets the whole chain
        return build(tokenizer, kind, spec, "p", parser_limits(), shape_checked=True)
    if sys.argv[1] == "compile_threads":
        threads = CompileThreads(1)
        for name, (kind, spec) in shapes.items():
            try:
                built = threads.submit(lambda: compile(kind, spec)).result()
            except ParamError as e:
                print(name, "refused", str(e)[:60].replace(" ", "_"))
                continue
            print(name, "compiled")
            def match():  # on a 256 KiB stack: matching must not recurse
                matcher = built.template.deep_copy()
                mask = np.zeros((1, 9), dtype=np.int32)
                for _ in range(20):
                    fill_next_token_bitmask(matcher, mask, 0)
                    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:259]
                    allowed = [t for t in np.nonzero(bits)[0] if t != 0]
                    if not allowed or not matcher.consume_token(int(allowed[0])):
                        break
                print(name, "matched")
            threading.stack_size(256 << 10)
            thread = threading.Thread(target=match)
            thread.start()
            thread.join()
    else:  # the control: an 8 MiB thread (the default) and a 3,000-link chain
        threading.stack_size(8 << 20)
        kind, spec = "json_schema", json.dumps(schema_chain(3000))
        thread = threading.Thread(target=lambda: compile(kind, spec))
        thread.start()
        thread.join()
        print("survived")
''')


def test_compile_threads_survive_the_crash_shapes_at_10x(tiny_model_dir: Path) -> None:
    """The three shapes that killed the server, at 10x the lengths (30,000 $refs, 20,000
    arrays, 30,000 rules) and with every bound skipped, compile or are refused cleanly on a
    compile thread, and what compiles matches on a 256 KiB stack; the 3,000-link chain kills
    a process on an 8 MiB thread (the shape is real)."""
    args = [str(TOOLS), str(tiny_model_dir / "tokenizer.json")]
    run = subprocess.run([sys.executable, "-c", _PROOF, "compile_threads", *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in run.stdout.split("\n") if line
                 and not line.endswith("matched"))
    assert lines == {"schema_chain": "compiled", "array_chain":
                     "refused p:_schema_too_large",
                     "grammar_chain": lines["grammar_chain"]}, run.stdout
    assert "schema_chain matched" in run.stdout
    assert lines["grammar_chain"] == "compiled" or "grammar_chain matched" not in run.stdout
    control = subprocess.run([sys.executable, "-c", _PROOF, "control", *args],
                             capture_output=True, text=True, timeout=600)
    assert control.returncode == -11 and "survived" not in control.stdout


def test_the_cache_is_bounded_in_bytes_with_tenant_shares() -> None:
    cache = CompiledCache(max_bytes=100, tenant_share=0.5)
    held = [Compiled(("a", i), None, 20, "a") for i in range(4)]
    for entry in held:
        cache.put(entry)
    assert cache.tenant_bytes("a") == 40 and len(cache) == 2  # a's share is 50 bytes
    assert cache.get(("a", 0)) is held[0]  # evicted, but still held by its request: found
    for i in range(3):
        cache.put(Compiled(("b", i), None, 15, "b"))
    assert cache.num_bytes == 85 and cache.tenant_bytes("a") == 40
    cache.put(Compiled(("c", 0), None, 30, "c"))  # over 100: the largest tenant (b) gives way
    assert cache.num_bytes <= 100 and cache.tenant_bytes("a") == 40
    assert cache.tenant_bytes("c") == 30
    too_big = Compiled(("c", 1), None, 60, "c")
    cache.put(too_big)  # over any share: never kept, yet found while referenced
    assert cache.get(("c", 1)) is too_big and cache.tenant_bytes("c") == 30
    del held, too_big
    gc.collect()
    assert cache.get(("a", 0)) is None and cache.get(("c", 1)) is None


@pytest.mark.asyncio
async def test_prepare_compiles_off_the_loop_and_tenants_take_turns(tiny_model_dir: Path
                                                                    ) -> None:
    """One worker: tenant a queues three compiles, then b one; b's runs second of the queued
    (a turn each), not after all of a's. A hit returns at once; a refusal names its field."""
    engine = make_engine(tiny_model_dir)
    engine.constraints.close()
    engine.constraints = ConstraintCompiler(engine.tokenizer.to_json, 259,
                                            engine.eos_token_ids, num_workers=1)
    done: list[str] = []
    async with AsyncEngine(engine) as async_engine:
        async def prepare(name: str, tenant: str) -> Compiled | None:
            compiled = await async_engine.prepare(
                Constraint("grammar", alternation(4000, name)), tenant, tenant)
            done.append(name)
            return compiled

        first = asyncio.create_task(prepare("a1", "a"))
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(prepare(n, "a")) for n in ("a2", "a3")]
        await asyncio.sleep(0.01)
        results = await asyncio.gather(first, *rest, prepare("b1", "b"))
        assert done.index("b1") < done.index("a3"), done
        again = await async_engine.prepare(Constraint("grammar", alternation(4000, "a1")),
                                           "a", "a")
        assert again is results[0]
        with pytest.raises(ParamError, match="no finite derivation") as info:
            await async_engine.prepare(Constraint("grammar", "start: start", "g"), "b")
        assert info.value.param == "g"
    engine.constraints.close()

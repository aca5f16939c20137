"""Memory of compiled constraints in one process: an AsyncEngine runs one 1-token request for
each of N unique ~220 KB enum schemas (tools/soak_constraints.py) and reports, every 20, the
resident set size and glibc's in-use heap (mallinfo2), where llguidance's grammars live. RSS also
counts the KV pool's pages as requests first touch them; the heap does not.

    flock /tmp/kvcore-bench.lock .venv/bin/python tools/bench_constraint_memory.py --schemas 120

Runs against an engine without AsyncEngine.prepare too (the constraint then compiles inside
generate), so the same command measures an older checkout."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import json
import os
from typing import Any

import soak_constraints as shapes
from kvcore.config import EngineConfig
from kvcore.engine import AsyncEngine, Engine
from kvcore.model.hub import ensure_default_model
from kvcore.sampling import SamplingParams
from kvcore.sampling.constraints import Constraint


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_LIBC.mallinfo2.restype = _MallInfo2


def heap_mb() -> int:
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd) >> 20


async def run(model: str, num_schemas: int) -> list[dict[str, Any]]:
    engine = Engine(EngineConfig(model=model, device="cpu"))
    rows = []
    async with AsyncEngine(engine) as async_engine:
        await asyncio.sleep(2.0)  # start-up work (llguidance's tokenizer) done
        prompt = engine.tokenizer.encode("x")
        rows.append({"schemas": 0, "rss_mb": shapes.rss_bytes(os.getpid()) >> 20,
                     "heap_mb": heap_mb()})
        print(rows[-1], flush=True)
        for i in range(num_schemas):
            schema = shapes.unique_enum(i)
            schema["title"] = f"bench-{i}"
            constraint = Constraint.json_schema(schema, "schema")
            prepare = getattr(async_engine, "prepare", None)
            held = await prepare(constraint, "t", "salt") if prepare is not None else None
            params = SamplingParams(max_tokens=1, constraint=constraint)
            async for _ in async_engine.generate(prompt, params, cache_salt="salt"):
                pass
            del held
            if (i + 1) % 20 == 0:
                rows.append({"schemas": i + 1, "rss_mb": shapes.rss_bytes(os.getpid()) >> 20,
                             "heap_mb": heap_mb()})
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the default model)")
    parser.add_argument("--schemas", type=int, default=120)
    args = parser.parse_args()
    model = args.model or str(ensure_default_model(progress=None))
    print(json.dumps(asyncio.run(run(model, args.schemas))))


if __name__ == "__main__":
    main()

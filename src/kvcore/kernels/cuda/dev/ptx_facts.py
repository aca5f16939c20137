"""Facts read from a kernel's PTX: 16-byte global loads, tensor-core instructions, cp.async
copies, and the shared-memory bytes one pass through its key-tile loop moves."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PTX_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
_VECTOR_LOAD = re.compile(r"\bld\.global[\w.]*\.(?:v4|v2\.(?:u64|b64|s64|f64))\b")
_TENSOR_CORE = re.compile(r"\b(?:wmma\.mma|mma\.sync)\b")
_CP_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\b[^;]*?\],\s*(\d+)\s*[,;]")
_SHARED_ACCESS = re.compile(
    r"\b(?:ld|st)(?:\.volatile)?\.shared(?:::cta)?(?:\.v(\d))?\.[a-z]+(\d+)\b")
_LABEL = re.compile(r"^(\$L__\w+):", re.M)
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")
_MAX_THREADS = re.compile(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)")


@dataclass(frozen=True, slots=True)
class PtxFacts:
    vector_loads: int  # 16-byte global loads
    tensor_core_ops: int  # wmma.mma / mma.sync
    cp_async: int  # cp.async copies
    tile_smem_bytes: int  # shared bytes per pass through the key-tile loop, whole block


def tile_loop(body: str) -> str:
    """The smallest loop (a label up to a branch back to it) holding a cp.async.wait_group and
    an mma.sync: the key-tile loop of a register-tile kernel; "" when there is none."""
    labels = {m.group(1): m.start() for m in _LABEL.finditer(body)}
    best = ""
    for m in _BRANCH.finditer(body):
        start = labels.get(m.group(1))
        if start is None or start > m.start():
            continue  # a forward branch
        loop = body[start:m.end()]
        if "cp.async.wait_group" in loop and "mma.sync" in loop and \
                (not best or len(loop) < len(best)):
            best = loop
    return best


def shared_bytes(code: str) -> int:
    """Bytes one thread moves through shared memory running `code` once: ld/st.shared widths
    and the sizes of the cp.async copies (each lands in shared memory)."""
    total = sum(int(m.group(1) or 1) * int(m.group(2)) // 8
                for m in _SHARED_ACCESS.finditer(code))
    return total + sum(int(size) for size in _CP_ASYNC.findall(code))


def ptx_facts(ptx: str) -> dict[str, PtxFacts]:
    """kernel -> what its PTX body shows (static counts: an unrolled loop counts once per
    unrolled copy, a rolled one once)."""
    parts = _PTX_ENTRY.split(ptx)
    # split gives [prefix, name, body, name, body, ...]
    out: dict[str, PtxFacts] = {}
    for i in range(1, len(parts) - 1, 2):
        body = parts[i + 1]
        bounds = _MAX_THREADS.search(body)
        threads = int(bounds.group(1)) * int(bounds.group(2)) * int(bounds.group(3)) \
            if bounds else 0
        out[parts[i]] = PtxFacts(len(_VECTOR_LOAD.findall(body)),
                                 len(_TENSOR_CORE.findall(body)),
                                 len(_CP_ASYNC.findall(body)),
                                 shared_bytes(tile_loop(body)) * threads)
    return out

"""Facts read from a kernel's PTX: 16-byte global loads, tensor-core instructions, cp.async
copies, and what one pass through its key-tile loop costs a warp: instructions, mma.sync,
ldmatrix, shared-memory pipe slots (and the bytes the whole block moves through shared memory).

Pipe slots: the shared-memory pipe serves one 128-byte wavefront per clock per SM, and a warp's
access takes whole wavefronts whatever it moves: a 1-, 2- or 4-byte ld/st.shared per lane is 1
slot (32, 64 or 128 bytes), 8 bytes 2, 16 bytes 4; an ldmatrix .x1/.x2/.x4 1/2/4 (one 8 x 8
matrix of 16-bit elements, 128 bytes, per slot); a cp.async of s bytes per lane s / 4 (at least
1). Conflict-free layouts are assumed (the kernels pad or swizzle their rows for that).
Counts are static: each instruction of the loop body once (both sides of a branch), so a loop
without inner loops (compile_check requires that of the register-tile kernels) gives an upper
bound of one pass per warp."""

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
_LDMATRIX = re.compile(r"\bldmatrix\.sync\.aligned\.m8n8\.x(\d)\b")
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?[a-z]", re.M)


@dataclass(frozen=True, slots=True)
class PtxFacts:
    vector_loads: int  # 16-byte global loads
    tensor_core_ops: int  # wmma.mma / mma.sync
    cp_async: int  # cp.async copies
    tile_smem_bytes: int  # shared bytes per pass through the key-tile loop, whole block
    tile_instructions: int = 0  # instructions of one pass through the tile loop (per warp)
    tile_mma: int = 0  # mma.sync per warp per pass
    tile_ldmatrix: int = 0  # ldmatrix per warp per pass
    tile_smem_slots: int = 0  # shared-memory pipe slots per warp per pass
    tile_inner_loops: int = 0  # backward branches inside the tile loop (0: straight counts)
    inner_instructions: int = 0  # of those inner loops' bodies, once each (per warp)
    inner_mma: int = 0
    inner_smem_slots: int = 0


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
    """Bytes one thread moves through shared memory running `code` once: ld/st.shared widths,
    its share of ldmatrix matrices, and the sizes of the cp.async copies (each lands in shared
    memory)."""
    total = sum(int(m.group(1) or 1) * int(m.group(2)) // 8
                for m in _SHARED_ACCESS.finditer(code))
    total += sum(4 * int(n) for n in _LDMATRIX.findall(code))  # 16 bytes per 8 lanes a matrix
    return total + sum(int(size) for size in _CP_ASYNC.findall(code))


def smem_slots(code: str) -> int:
    """Shared-memory pipe slots one warp takes running `code` once (see the module's note)."""
    slots = sum(max(1, int(m.group(1) or 1) * int(m.group(2)) // 32)
                for m in _SHARED_ACCESS.finditer(code))
    slots += sum(int(n) for n in _LDMATRIX.findall(code))
    return slots + sum(max(1, int(size) // 4) for size in _CP_ASYNC.findall(code))


def instructions(code: str) -> int:
    """PTX instructions in `code` (not labels, directives or braces)."""
    return len(_INSTRUCTION.findall(code))


def inner_loops(loop: str) -> list[str]:
    """The bodies of the loops inside `loop` (a label up to a backward branch to it, other
    than the branch closing `loop`)."""
    labels = {m.group(1): m.start() for m in _LABEL.finditer(loop)}
    branches = list(_BRANCH.finditer(loop))
    return [loop[labels[m.group(1)]:m.end()] for m in branches[:-1]
            if m.group(1) in labels and labels[m.group(1)] < m.start()]


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
        loop = tile_loop(body)
        inner = inner_loops(loop)
        out[parts[i]] = PtxFacts(len(_VECTOR_LOAD.findall(body)),
                                 len(_TENSOR_CORE.findall(body)),
                                 len(_CP_ASYNC.findall(body)),
                                 shared_bytes(loop) * threads, instructions(loop),
                                 len(_TENSOR_CORE.findall(loop)), len(_LDMATRIX.findall(loop)),
                                 smem_slots(loop), len(inner),
                                 sum(instructions(x) for x in inner),
                                 sum(len(_TENSOR_CORE.findall(x)) for x in inner),
                                 sum(smem_slots(x) for x in inner))
    return out

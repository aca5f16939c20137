"""Static evidence for the CUDA kernels, without a GPU: NVRTC compiles every kernel variant.

`python -m kvcore.kernels.cuda.dev.compile_check [--json]` compiles each .cu source (each
decode variant: head_dim x GQA group (1 to 32) x activation/cache dtype, the cache dtype "int4"
selecting the KVC_INT4 variants of the register-tile kernels; the MLA kernel per latent shape x
dtype) to a cubin for sm_80 and sm_90 through CuPy's NVRTC with CuPy's own options, and reports
per kernel: registers, stack, spill bytes, static shared memory (ptxas' verbose log), the
dynamic shared memory the launcher asks for, and facts read from the PTX of the same compile
(ptx_facts): 16-byte global loads, tensor-core instructions, cp.async copies, and for one pass
through the key-tile loop (the smallest PTX loop holding a cp.async.wait_group and an mma.sync)
the shared-memory bytes the block moves and, per warp, the instructions, mma.sync, ldmatrix and
shared-memory pipe slots (the traffic model's inputs: traffic_model). It exits non-zero on a
compile error, any spill, shared memory above the arch's opt-in limit, a CUDA-core decode
variant of a group up to 8 above DECODE_REGISTER_BUDGET registers or without 16-byte loads, a
tensor-core variant without tensor-core instructions, a register-tile kernel without cp.async, a
16-bit one without ldmatrix, a decode tile loop with inner loops or over DECODE_TILE_BUDGET, or
more shared-memory bytes per tile than TILE_SMEM_RATIO x the tile's global bytes per 16-row
block (prefill: PREFILL_TILE_SMEM_LIMIT per 64 x 64 tile; MLA: MLA_KEY_SMEM_LIMIT per cached
key). The runtime compiles with the same `nvrtc_options()` (kvcore.kernels.cuda.nvrtc).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvcore.kernels.cuda.dev.compile_variants import (
    ARCHS,
    CHECK_DTYPES,
    CHECK_GROUPS,
    CHECK_HEAD_DIMS,
    KERNEL_DIR,
    SMEM_OPT_IN,
    Variant,
    kernel_sources,
    variants,
)
from kvcore.kernels.cuda.dev.ptx_facts import PtxFacts, ptx_facts
from kvcore.kernels.cuda.nvrtc import nvrtc_options

__all__ = ["ARCHS", "KERNEL_DIR", "SMEM_OPT_IN", "KernelReport", "Variant", "check_variants",
           "compile_source", "kernel_sources", "main", "nvrtc_options", "parse_ptxas_log",
           "problems", "ptx_facts", "variants"]

DECODE_REGISTER_BUDGET = 96  # sm_90, groups up to 8: 5 blocks of 4 warps (2.5 of 8) per SM
TENSOR_CORE_KERNELS = ("paged_attention_prefill_tc", "paged_attention_decode_tc",
                       "mla_paged_attention")
# kernels that keep S, P, O in registers and stage K/V with cp.async: their limits
REGISTER_TILE_KERNELS = ("paged_attention_decode_tc", "paged_attention_prefill_mma",
                         "mla_paged_attention")
TILE_SMEM_RATIO = 2.0  # decode: shared-memory bytes per key tile over its global (K + V) bytes
PREFILL_TILE_SMEM_LIMIT = 150 * 1024  # prefill: shared bytes per 64 query rows x 64 keys
PREFILL_MMA_ROWS = 128  # query rows of a paged_attention_prefill_mma block (per key tile)
# MLA: shared-memory bytes per cached key of a 64-row block (the traffic model's 13 KB at
# DeepSeek's 512 + 64, 16-bit cache: mostly the Q and K fragments of S)
MLA_KEY_SMEM_LIMIT = 14 * 1024
# sm_90, head_dim 128, GQA up to 16, fp16 activations: per warp and pass through the key-tile
# loop, at most these PTX instructions and shared-memory pipe slots (ptx_facts; the figures of
# docs/gpu-performance.md's traffic model, with room for compiler drift)
# (int4: the static count takes the window-row paths too; the traffic model counts the common
# all-sealed tile from the KVC_INT4_PROBE_SEALED compile)
DECODE_TILE_BUDGET = {"16-bit": (800, 140), "int4": (2100, 300)}


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass(frozen=True, slots=True)
class KernelReport:
    source: str
    kernel: str
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    static_smem: int
    variant: str = ""  # the -D options of the compile ("" = the source as is)
    dynamic_smem: int = 0  # what the launcher requests for this variant
    vector_loads: int = 0  # 16-byte global loads in the kernel's PTX
    tensor_core_ops: int = 0  # wmma.mma / mma.sync in the kernel's PTX
    cp_async: int = 0  # cp.async copies in the kernel's PTX
    tile_smem_bytes: int = 0  # shared-memory bytes one pass through the key-tile loop moves
    tile_global_bytes: int = 0  # the K + V bytes of one key tile (register-tile kernels)
    tile_instructions: int = 0  # PTX instructions of one pass through the tile loop, per warp
    tile_mma: int = 0  # mma.sync per warp per pass
    tile_ldmatrix: int = 0  # ldmatrix per warp per pass
    tile_smem_slots: int = 0  # shared-memory pipe slots (128-byte wavefronts) per warp per pass
    tile_inner_loops: int = 0  # loops inside the tile loop (their bodies counted once above)
    inner_instructions: int = 0  # instructions of those inner loops' bodies, once each
    inner_mma: int = 0
    inner_smem_slots: int = 0


def cupy_options(arch: str) -> tuple[str, ...]:
    """What CuPy's RawModule adds for a device of compute capability `arch` (cupy 13/14):
    its header dir and CCCL, flush-to-zero, a cubin for the arch and device-default functions."""
    from cupy._core import core  # type: ignore[import-not-found]

    return (f"-I{core._get_header_dir_path()}", *core._get_cccl_include_options(), "-ftz=true",
            f"-arch=sm_{arch}", "--device-as-default-execution-space")


def compile_source(path: Path, arch: str, defines: tuple[str, ...] = (),
                   dynamic_smem: int = 0, tile_global_bytes: int = 0) -> list[KernelReport]:
    """Compile one source (one variant) for one arch; raises cupy's CompileException on an
    error. NVRTC keeps the PTX of a cubin compile, so one compile gives both reports."""
    from cupy.cuda import compiler
    from cupy_backends.cuda.libs import nvrtc  # type: ignore[import-not-found]

    options = (*nvrtc_options(), *cupy_options(arch), *(f"-D{d}" for d in defines),
               "--ptxas-options=-v")
    program = compiler._NVRTCProgram(path.read_text(), path.name, method="cubin")
    log = io.StringIO()
    program.compile(options, log)
    ptx = nvrtc.getPTX(program.ptr)
    facts = ptx_facts(ptx.decode() if isinstance(ptx, bytes) else ptx)
    none = PtxFacts(0, 0, 0, 0)
    out = []
    for r in parse_ptxas_log(path.name, log.getvalue()):
        f = facts.get(r.kernel, none)
        out.append(dataclasses.replace(
            r, variant=" ".join(defines), dynamic_smem=dynamic_smem,
            vector_loads=f.vector_loads, tensor_core_ops=f.tensor_core_ops, cp_async=f.cp_async,
            tile_smem_bytes=f.tile_smem_bytes, tile_global_bytes=tile_global_bytes,
            tile_instructions=f.tile_instructions, tile_mma=f.tile_mma,
            tile_ldmatrix=f.tile_ldmatrix, tile_smem_slots=f.tile_smem_slots,
            tile_inner_loops=f.tile_inner_loops, inner_instructions=f.inner_instructions,
            inner_mma=f.inner_mma, inner_smem_slots=f.inner_smem_slots))
    return out


def parse_ptxas_log(source: str, log: str) -> list[KernelReport]:
    """One report per 'Compiling entry function' block of ptxas' verbose output."""
    reports: list[KernelReport] = []
    blocks = _ENTRY.split(log)
    # split gives [prefix, name, arch, body, name, arch, body, ...]
    for i in range(1, len(blocks) - 2, 3):
        name, arch, body = blocks[i], blocks[i + 1], blocks[i + 2]
        stack, regs, smem = _STACK.search(body), _REGS.search(body), _SMEM.search(body)
        if stack is None or regs is None:
            raise RuntimeError(f"cannot read ptxas report of {name} in {source}:\n{body}")
        reports.append(KernelReport(source, name, arch, int(regs.group(1)), int(stack.group(1)),
                                    int(stack.group(2)), int(stack.group(3)),
                                    int(smem.group(1)) if smem else 0))
    return reports


def check_variants(chosen: list[Variant], archs: tuple[str, ...] = ARCHS) -> list[KernelReport]:
    reports = [r for v in chosen for arch in archs if arch in v.archs
               for r in compile_source(KERNEL_DIR / v.source, arch, v.defines, v.dynamic_smem,
                                       v.tile_global_bytes)]
    if not reports:
        raise RuntimeError(f"no kernels found under {KERNEL_DIR}")
    return reports


def problems(reports: list[KernelReport], chosen: list[Variant]) -> list[str]:
    """What fails the check: spills anywhere, shared memory over the arch's opt-in limit, decode
    over budget or without 16-byte loads, a tensor-core kernel without tensor-core ops."""
    group_of = {" ".join(v.defines): v.group for v in chosen if v.group}
    found: list[str] = []
    for r in reports:
        where = f"{r.kernel} [{r.variant}] sm_{r.arch}"
        if r.spill_stores or r.spill_loads:
            found.append(f"register spill: {where} ({r.spill_stores} bytes stored, "
                         f"{r.spill_loads} loaded)")
        if r.kernel == "paged_attention_decode":
            if group_of.get(r.variant, 0) <= 8 and r.arch == "90" and \
                    r.registers > DECODE_REGISTER_BUDGET:
                found.append(f"over the register budget: {where} uses {r.registers} > "
                             f"{DECODE_REGISTER_BUDGET}")
            if r.vector_loads == 0:
                found.append(f"no 16-byte global loads: {where}")
        if r.kernel in TENSOR_CORE_KERNELS and r.tensor_core_ops == 0:
            found.append(f"no tensor-core instructions: {where}")
        found += _tile_problems(r, where, group_of.get(r.variant, 0))
        if "KVC_INT4" in r.variant:
            # int4 variants: the tile moves packed codes, not the 16-bit rows the byte ratios
            # below are written for
            if r.cp_async == 0 or r.tile_smem_bytes == 0:
                found.append(f"no cp.async key-tile loop: {where}")
        elif r.kernel in REGISTER_TILE_KERNELS:
            if r.cp_async == 0:
                found.append(f"no cp.async staging: {where}")
            if r.kernel == "mla_paged_attention":
                per_key = r.tile_smem_bytes // _mla_tile_keys(r.variant)
                if per_key == 0 or per_key > MLA_KEY_SMEM_LIMIT:
                    found.append(f"shared-memory traffic per cached key: {where} moves "
                                 f"{per_key} bytes (at most {MLA_KEY_SMEM_LIMIT}; 0 = no tile "
                                 "loop found)")
            elif r.kernel == "paged_attention_prefill_mma":
                per_64 = r.tile_smem_bytes * 64 // PREFILL_MMA_ROWS
                if per_64 == 0 or per_64 > PREFILL_TILE_SMEM_LIMIT:
                    found.append(f"shared-memory traffic per 64 x 64 tile: {where} moves "
                                 f"{per_64} bytes (at most {PREFILL_TILE_SMEM_LIMIT}; 0 = no "
                                 "tile loop found)")
            elif r.tile_smem_bytes == 0 or r.tile_smem_bytes > \
                    _row_blocks(group_of.get(r.variant, 0)) * TILE_SMEM_RATIO * r.tile_global_bytes:
                found.append(f"shared-memory traffic per key tile: {where} moves "
                             f"{r.tile_smem_bytes} bytes for a tile of {r.tile_global_bytes} "
                             f"(at most {TILE_SMEM_RATIO:g}x per 16-row block; 0 = no tile "
                             "loop found)")
        if r.static_smem + r.dynamic_smem > SMEM_OPT_IN.get(r.arch, SMEM_OPT_IN["80"]):
            found.append(f"shared memory over the sm_{r.arch} limit: {where} needs "
                         f"{r.static_smem + r.dynamic_smem} bytes")
    return found


def _row_blocks(group: int) -> int:
    """16-row blocks of a decode variant's group: each reads the tile's K and V once."""
    return max(1, -(-group // 16))


def _tile_problems(r: KernelReport, where: str, group: int) -> list[str]:
    """The key-tile loop's counts: ldmatrix in the 16-bit register-tile kernels, a straight
    16-bit decode loop (its counts are per pass; int4 keeps its rare window-row loop rolled),
    and the decode budgets at the reference shape."""
    if r.kernel not in REGISTER_TILE_KERNELS or r.tile_instructions == 0:
        return []  # (no tile loop found: the byte checks below report that)
    found: list[str] = []
    fp8 = "fp8" in r.variant
    int4 = "KVC_INT4" in r.variant
    decode = r.kernel == "paged_attention_decode_tc"
    if not fp8 and not (int4 and decode) and r.tile_ldmatrix == 0:
        found.append(f"no ldmatrix in the key-tile loop: {where}")
    if decode and not int4 and not fp8 and r.tile_inner_loops:
        found.append(f"the key-tile loop has {r.tile_inner_loops} inner loops (its counts would "
                     f"not be per pass): {where}")
    if decode and r.arch == "90" and "KVC_HEAD_DIM=128" in r.variant and group <= 16 and \
            "__half" in r.variant.split("KVC_SCALAR=")[-1].split()[0] and not fp8:
        instructions, slots = DECODE_TILE_BUDGET["int4" if int4 else "16-bit"]
        if r.tile_instructions > instructions or r.tile_smem_slots > slots:
            found.append(f"over the decode tile budget: {where} takes {r.tile_instructions} "
                         f"instructions and {r.tile_smem_slots} shared slots per warp and tile "
                         f"(at most {instructions} and {slots})")
    return found


def _mla_tile_keys(variant: str) -> int:
    """Keys per tile of an MLA variant, from its -D options (the kernel's default shape and tile
    when they are absent)."""
    value = dict(d.split("=", 1) for d in variant.split() if "=" in d)
    return int(value.get("KVC_MLA_KEYS", 32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(CHECK_HEAD_DIMS),
                        help="decode head_dims to compile (default: %(default)s)")
    parser.add_argument("--groups", type=int, nargs="+", default=list(CHECK_GROUPS),
                        help="decode GQA groups to compile (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", default=[f"{a}-{c}" for a, c in CHECK_DTYPES],
                        help="decode activation-cache dtype pairs (default: %(default)s)")
    parser.add_argument("--sources", nargs="+", metavar="NAME.cu",
                        help="only these sources (default: every .cu)")
    args = parser.parse_args(argv)
    pairs = tuple(tuple(d.split("-", 1)) for d in args.dtypes)
    if any(len(p) != 2 for p in pairs):
        parser.error(f"--dtypes wants ACT-CACHE pairs such as f16-fp8, got {args.dtypes}")
    chosen = variants(tuple(args.head_dims), tuple(args.groups),
                      tuple((p[0], p[1]) for p in pairs))
    if args.sources:
        unknown = set(args.sources) - {p.name for p in kernel_sources()}
        if unknown:
            parser.error(f"--sources: no such kernel source {sorted(unknown)}")
        chosen = [v for v in chosen if v.source in args.sources]
    try:
        reports = check_variants(chosen)
    except Exception as exc:  # a compile error: print NVRTC's log, fail
        print(f"compile failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        for r in reports:
            print(json.dumps(dataclasses.asdict(r)))
    else:
        print(f"{'kernel':28} {'variant':62} {'arch':>5} {'regs':>4} {'spill':>5} "
              f"{'smem':>7} {'mma':>4} {'cp.as':>5} {'tile smem/global':>17} "
              f"{'instr/w':>7} {'slots/w':>7} {'ldm/w':>5}")
        for r in reports:
            variant = r.variant.replace("KVC_", "")
            tile = f"{r.tile_smem_bytes}/{r.tile_global_bytes}" if r.tile_global_bytes else "-"
            print(f"{r.kernel:28} {variant:62} sm_{r.arch:>2} {r.registers:4d} "
                  f"{r.spill_stores + r.spill_loads:5d} {r.static_smem + r.dynamic_smem:7d} "
                  f"{r.tensor_core_ops:4d} {r.cp_async:5d} {tile:>17} "
                  f"{r.tile_instructions:7d} {r.tile_smem_slots:7d} {r.tile_ldmatrix:5d}")
    found = problems(reports, chosen)
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())

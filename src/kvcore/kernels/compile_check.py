"""Compile every .cu kernel source through CuPy's NVRTC with CuPy's own options, without a GPU.

`python -m kvcore.kernels.compile_check` compiles each source to a cubin for sm_80 and sm_90,
prints the registers, stack and spills of every kernel from ptxas' report, and exits non-zero on
any compile error or register spill. cuda.py loads the kernels with the same `nvrtc_options()`.
"""

from __future__ import annotations

import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
ARCHS = ("80", "90")

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


def kernel_sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h & co.: the CUDA wheels' include dirs, or a CUDA install."""
    candidates: list[Path] = []
    for entry in sys.path:
        root = Path(entry) / "nvidia"
        candidates += [root / "cuda_runtime" / "include", root / "cu13" / "include",
                       root / "cu12" / "include"]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    found: list[str] = []
    for path in candidates:
        if (path / "cuda_fp16.h").is_file() and str(path) not in found:
            found.append(str(path))
    return found


def nvrtc_options() -> tuple[str, ...]:
    """The options kvcore passes to cupy.RawModule (CuPy adds its own, see `cupy_options`)."""
    return ("--std=c++17", f"-I{KERNEL_DIR}", *(f"-I{d}" for d in cuda_include_dirs()))


def cupy_options(arch: str) -> tuple[str, ...]:
    """What CuPy's RawModule adds for a device of compute capability `arch` (cupy 13/14):
    its header dir and CCCL, flush-to-zero, a cubin for the arch and device-default functions."""
    from cupy._core import core  # type: ignore[import-not-found]

    return (f"-I{core._get_header_dir_path()}", *core._get_cccl_include_options(), "-ftz=true",
            f"-arch=sm_{arch}", "--device-as-default-execution-space")


def compile_source(path: Path, arch: str, defines: tuple[str, ...] = ()) -> list[KernelReport]:
    """Compile one source for one arch; raises cupy's CompileException on an error."""
    from cupy.cuda import compiler  # type: ignore[import-not-found]

    options = (*nvrtc_options(), *cupy_options(arch), *defines, "--ptxas-options=-v")
    program = compiler._NVRTCProgram(path.read_text(), path.name, method="cubin")
    log = io.StringIO()
    program.compile(options, log)
    return parse_ptxas_log(path.name, log.getvalue())


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


def check_all(archs: tuple[str, ...] = ARCHS) -> list[KernelReport]:
    reports = [r for src in kernel_sources() for arch in archs for r in compile_source(src, arch)]
    if not reports:
        raise RuntimeError(f"no kernels found under {KERNEL_DIR}")
    return reports


def main() -> int:
    try:
        reports = check_all()
    except Exception as exc:  # a compile error: print NVRTC's log, fail
        print(f"compile failed: {exc}", file=sys.stderr)
        return 1
    print(f"{'source':28} {'kernel':36} {'arch':>5} {'regs':>5} {'stack':>6} {'spills':>7}")
    for r in reports:
        print(f"{r.source:28} {r.kernel:36} sm_{r.arch:>2} {r.registers:5d} {r.stack_bytes:6d} "
              f"{r.spill_stores + r.spill_loads:7d}")
    spilled = [r for r in reports if r.spill_stores or r.spill_loads]
    for r in spilled:
        print(f"register spill: {r.kernel} sm_{r.arch} ({r.spill_stores} bytes stored, "
              f"{r.spill_loads} bytes loaded)", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU emulation of CUDA kernels: the unchanged .cu sources built with g++ and run as fibers.

`EmuModule(path)` plays `cupy.RawModule`: `get_function(name)` returns a kernel called as
`kernel(grid, block, args, shared_mem=...)`, with NumPy arrays for device pointers (written in
place) and NumPy scalars for by-value parameters (Python int/float pass as int64/float64, as
CuPy does; the launcher checks them against the kernel's parameter types). Every launch runs in
a worker subprocess, so a wild pointer kills the worker, not the test runner.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
KERNEL_DIR = HERE.parents[1] / "src" / "kvcore" / "kernels" / "cuda"
CACHE_DIR = Path(os.environ.get("KVCORE_EMU_CACHE")
                 or Path(tempfile.gettempdir()) / "kvcore_cuda_emu")
DYNAMIC_SMEM_CAPACITY = 228 * 1024
DEFAULT_SMEM_LIMIT = 48 * 1024  # what a kernel may use without opting in
SM90_SMEM_OPT_IN = 227 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin of an H100 / H200

_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?'
                        r"(\w+)\s*\(")
_MACRO_KERNEL_RE = re.compile(r"^\s*(KVC_\w+)\((\w+)\s*,", re.M)
_SMEM_RE = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?[\w\s:]*?(\w+)\s*\[\s*\]")


@dataclass(frozen=True, slots=True)
class PointerArray:
    """A device array of the addresses of `arrays` (int64), built where the kernel runs."""

    arrays: tuple[np.ndarray, ...]


def _cuda_include_dir() -> str:
    for entry in sys.path:
        path = Path(entry) / "nvidia" / "cuda_runtime" / "include"
        if (path / "cuda_fp16.h").is_file():
            return str(path)
    raise RuntimeError("NVIDIA's CUDA headers not found: pip install nvidia-cuda-runtime-cu12")


def _libcudacxx_include_dir() -> str:
    # cuda_fp16.h includes <nv/target>, which CuPy ships with its CCCL copy
    import cupy  # noqa: F401  (only to locate the package; imports without a GPU)

    path = Path(cupy.__file__).parent / "_core" / "include" / "cupy" / "_cccl" / "libcudacxx"
    if not (path / "nv" / "target").is_file():
        raise RuntimeError(f"<nv/target> not found under {path}")
    return str(path)


def kernel_names(source: str) -> list[str]:
    """extern "C" __global__ entry points, written out or through KVC_* instantiation macros."""
    names = [n for n in _KERNEL_RE.findall(source) if not n.startswith("__")]
    macros: dict[str, list[str]] = {}
    for m in re.finditer(r"#define\s+(KVC_\w+)\(suffix", source):
        body: list[str] = []
        for line in source[m.start():].splitlines():
            body.append(line)
            if not line.rstrip().endswith("\\"):
                break
        macros[m.group(1)] = re.findall(r"(\w+)##suffix", "\n".join(body))
    for macro, suffix in _MACRO_KERNEL_RE.findall(source):
        names += [prefix + suffix for prefix in macros.get(macro, [])]
    return names


def _runtime_object(includes: list[str]) -> Path:
    """emu_runtime.cpp compiled once (cached by content): half of a kernel build's time."""
    flags = ["-std=c++17", "-O1", "-fPIC", "-c", "-fno-strict-aliasing", "-fvisibility=hidden",
             "-w", *(f"-I{d}" for d in includes[:1] + includes[2:])]
    deps = [(HERE / name).read_text() for name in ("emu_runtime.cpp", "cuda_emu.h",
                                                   "crt/host_defines.h")]
    key = hashlib.sha256("\0".join([*deps, " ".join(flags)]).encode()).hexdigest()[:20]
    obj = CACHE_DIR / f"emu_runtime-{key}.o"
    if not obj.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = CACHE_DIR / f"emu_runtime-{key}-{os.getpid()}.o"
        cmd = ["g++", *flags, "-include", str(HERE / "cuda_emu.h"), str(HERE / "emu_runtime.cpp"),
               "-o", str(tmp)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"g++ failed on emu_runtime.cpp:\n{result.stderr[-6000:]}")
        os.replace(tmp, obj)
    return obj


def build(path: Path, defines: Sequence[str] = ()) -> tuple[Path, list[str]]:
    """Compile `path` with the harness into a shared library (cached by content hash)."""
    source = path.read_text()
    names = kernel_names(source)
    smem = sorted(set(_SMEM_RE.findall(source)))
    includes = [str(HERE), str(path.parent), _cuda_include_dir(), _libcudacxx_include_dir()]
    flags = ["-std=c++17", "-O1", "-fPIC", "-shared", "-fno-strict-aliasing",
             "-fvisibility=hidden", "-w", *(f"-D{d}" for d in defines),
             *(f"-I{d}" for d in includes)]
    deps = [source, (HERE / "cuda_emu.h").read_text(), (HERE / "emu_runtime.cpp").read_text(),
            (HERE / "crt" / "host_defines.h").read_text(), (HERE / "mma.h").read_text(),
            (HERE / "ptx_ops.cuh").read_text(), " ".join(flags)]
    deps += [p.read_text() for p in sorted(path.parent.glob("*.cuh"))]
    key = hashlib.sha256("\0".join(deps).encode()).hexdigest()[:20]
    lib = CACHE_DIR / f"{path.stem}-{key}.so"
    if lib.exists():
        return lib, names
    work = CACHE_DIR / f"{path.stem}-{key}-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    kernels = work / "kernels.cpp"
    kernels.write_text(f'#include "{path}"\n' + "".join(f"EMU_KERNEL({n})\n" for n in names))
    shared = work / "smem.cpp"
    shared.write_text(
        "".join(f"alignas(16) thread_local unsigned char {n}[{DYNAMIC_SMEM_CAPACITY}];\n"
                for n in smem)
        + f'extern "C" int emu_num_dynamic_smem() {{ return {len(smem)}; }}\n'
        + 'extern "C" unsigned char* emu_dynamic_smem(int i) {\n'
        + "".join(f"  if (i == {i}) return {n};\n" for i, n in enumerate(smem))
        + "  return nullptr;\n}\n"
        + 'extern "C" unsigned long emu_dynamic_smem_capacity() '
        + f"{{ return {DYNAMIC_SMEM_CAPACITY}; }}\n")
    tmp = work / "lib.so"
    cmd = ["g++", *flags, "-include", str(HERE / "cuda_emu.h"), str(kernels), str(shared),
           str(_runtime_object(includes)), "-o", str(tmp)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"g++ failed on {path.name}:\n{result.stderr[-6000:]}")
    os.replace(tmp, lib)  # atomic: a concurrent build of the same key is harmless
    shutil.rmtree(work, ignore_errors=True)
    return lib, names


class _Worker:
    """One persistent subprocess that loads the libraries and runs launches."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: Any = None

    def _start(self) -> subprocess.Popen[bytes]:
        # a file, not a pipe: nobody reads it until the worker dies, so it must never fill up
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen([sys.executable, str(HERE / "worker.py")],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._stderr)
        return self._proc

    def call(self, request: tuple[Any, ...]) -> Any:
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
        assert proc.stdin is not None and proc.stdout is not None
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            proc.stdin.write(struct.pack("<Q", len(payload)) + payload)
            proc.stdin.flush()
            header = proc.stdout.read(8)
            if len(header) < 8:
                raise BrokenPipeError
            body = proc.stdout.read(struct.unpack("<Q", header)[0])
        except BrokenPipeError:
            code = proc.wait()
            self._stderr.seek(0)
            tail = self._stderr.read().decode(errors="replace")[-3000:]
            self._proc = None
            raise RuntimeError(f"emulated launch crashed the worker (exit {code}):\n{tail}") \
                from None
        ok, value = pickle.loads(body)
        if not ok:
            raise RuntimeError(value)
        return value


_WORKER = _Worker()


def _span(view: np.ndarray, name: str) -> np.ndarray:
    """The bytes from a strided view's first to its last element, aliasing its memory: what a
    kernel given the view's data pointer may address."""
    if any(st < 0 for st in view.strides):
        raise ValueError(f"{name} has negative strides")
    nbytes = sum((n - 1) * st for n, st in zip(view.shape, view.strides, strict=True))
    nbytes += view.dtype.itemsize
    buffer = (ctypes.c_uint8 * nbytes).from_address(view.ctypes.data)
    return np.ctypeslib.as_array(buffer)


class EmuKernel:
    def __init__(self, module: EmuModule, name: str) -> None:
        self.module = module
        self.name = name
        # as cupy.RawKernel's attribute: raise it to launch with more than 48 KiB
        self.max_dynamic_shared_size_bytes = DEFAULT_SMEM_LIMIT

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any],
                 shared_mem: int = 0) -> None:
        grid3 = (*grid, 1, 1)[:3]
        block3 = (*block, 1, 1)[:3]
        specs: list[tuple[str, Any]] = []
        targets: list[np.ndarray] = []
        for i, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                if not arg.flags.c_contiguous:
                    arg = _span(arg, f"{self.name}: argument {i}")
                specs.append(("a", arg))
                targets.append(arg)
            elif isinstance(arg, PointerArray):
                specs.append(("p", arg.arrays))
                targets.extend(arg.arrays)
            elif isinstance(arg, np.generic):
                specs.append(("s", arg))
            elif isinstance(arg, bool):
                specs.append(("s", np.bool_(arg)))
            elif isinstance(arg, int):
                specs.append(("s", np.int64(arg)))
            elif isinstance(arg, float):
                specs.append(("s", np.float64(arg)))
            else:
                raise TypeError(f"{self.name}: unsupported argument {i} of type {type(arg)}")
        lib = self.module.library()
        results = _WORKER.call((str(lib), self.name, grid3, block3, int(shared_mem),
                                int(self.max_dynamic_shared_size_bytes),
                                int(self.module.order_seed), specs))
        for target, result in zip(targets, results, strict=True):
            np.copyto(target, result.view(target.dtype).reshape(target.shape))


class EmuModule:
    """Stands in for cupy.RawModule(code=open(path).read()); `order_seed` permutes thread order."""

    def __init__(self, path: Path, defines: Sequence[str] = (), order_seed: int = 0) -> None:
        self.path = Path(path)
        self.defines = tuple(defines)
        self.order_seed = order_seed
        self._lib: Path | None = None
        self._names: list[str] = []

    def library(self) -> Path:
        if self._lib is None:
            self._lib, self._names = build(self.path, self.defines)
        return self._lib

    def get_function(self, name: str) -> EmuKernel:
        self.library()
        if name not in self._names:
            raise KeyError(f"{name} is not a kernel of {self.path.name}: {sorted(self._names)}")
        return EmuKernel(self, name)


class _PoisonedNumpy:
    """NumPy whose `empty` returns NaN-filled (or 0x5a-byte) arrays: unwritten outputs show."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def empty(shape: Any, dtype: Any = np.float32) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if out.dtype.kind == "f" or out.dtype.name in ("bfloat16", "float8_e4m3fn"):
            out[...] = np.nan
        else:
            out.view(np.uint8)[...] = 0x5A
        return out


class EmuBackend:
    """The kvcore.kernels.cuda.ops backend that runs the kernels under emulation (NumPy arrays)."""

    xp = _PoisonedNumpy()

    def __init__(self, defines: Sequence[str] = (), order_seed: int = 0, num_sms: int = 8,
                 smem_opt_in: int = SM90_SMEM_OPT_IN) -> None:
        self.defines = tuple(defines)
        self.order_seed = order_seed
        self.num_sms = num_sms  # a small device, so that split-KV partitions show up in tests
        self.smem_opt_in = smem_opt_in  # what a block may opt in to (sm_80: 163 KB)
        self._modules: dict[tuple[str, tuple[str, ...]], EmuModule] = {}

    def function(self, source: str, name: str, defines: tuple[str, ...] = ()) -> EmuKernel:
        module = self._modules.get((source, defines))
        if module is None:
            module = self._modules[source, defines] = EmuModule(KERNEL_DIR / source,
                                                                (*self.defines, *defines))
        module.order_seed = self.order_seed
        kernel = module.get_function(name)
        kernel.max_dynamic_shared_size_bytes = self.smem_opt_in  # opted in, as CupyBackend
        return kernel

    def pointer_array(self, arrays: Sequence[np.ndarray]) -> PointerArray:
        return PointerArray(tuple(arrays))

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

"""Worker process of the CUDA emulation harness: loads kernel libraries and runs launches.

Reads length-prefixed pickled requests on stdin, answers (ok, arrays | message) on stdout. A
kernel that corrupts memory takes only this process down; the parent reports its stderr.
"""

from __future__ import annotations

import ctypes
import pickle
import struct
import sys
from typing import Any

import numpy as np

_CTYPES = {"i": ctypes.c_int32, "I": ctypes.c_uint32, "q": ctypes.c_int64, "Q": ctypes.c_uint64,
           "f": ctypes.c_float, "d": ctypes.c_double, "?": ctypes.c_bool}
_CODES = {np.dtype(np.int32): "i", np.dtype(np.uint32): "I", np.dtype(np.int64): "q",
          np.dtype(np.uint64): "Q", np.dtype(np.float32): "f", np.dtype(np.float64): "d",
          np.dtype(np.bool_): "?"}
_LIBS: dict[str, ctypes.CDLL] = {}


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """A fresh copy on a 256-byte boundary, as cudaMalloc gives (vector loads rely on it)."""
    raw = np.empty(array.nbytes + 256, dtype=np.uint8)
    offset = -raw.ctypes.data % 256
    out = raw[offset:offset + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def launch(lib_path: str, name: str, grid: tuple[int, int, int], block: tuple[int, int, int],
           shared_mem: int, smem_limit: int, seed: int, specs: list[tuple[str, Any]]
           ) -> list[np.ndarray]:
    lib = _LIBS.get(lib_path)
    if lib is None:
        lib = _LIBS[lib_path] = ctypes.CDLL(lib_path)
        lib.emu_launch.restype = ctypes.c_int
    sig_fn = getattr(lib, f"emu_sig_{name}")
    sig_fn.restype = ctypes.c_char_p
    signature = sig_fn().decode()
    if len(signature) != len(specs):
        raise TypeError(f"{name} takes {len(signature)} arguments, got {len(specs)}")
    arrays: list[np.ndarray] = []
    storage: list[Any] = []
    for i, ((kind, value), code) in enumerate(zip(specs, signature, strict=True)):
        if kind in ("a", "p"):
            if code != "P":
                raise TypeError(f"{name} argument {i}: kernel expects '{code}', got an array")
            if kind == "a":
                arr = _aligned_copy(value)
                arrays.append(arr)
                storage.append(ctypes.c_void_p(arr.ctypes.data))
            else:
                members = [_aligned_copy(a) for a in value]
                arrays.extend(members)
                table = _aligned_copy(np.array([a.ctypes.data for a in members], dtype=np.int64))
                storage += [table, ctypes.c_void_p(table.ctypes.data)]
        else:
            got = _CODES.get(value.dtype)
            if got != code:
                raise TypeError(f"{name} argument {i}: kernel expects '{code}', got {value.dtype}")
            storage.append(_CTYPES[code](value.item()))
    pointers = [ctypes.cast(ctypes.pointer(s), ctypes.c_void_p).value for s in storage
                if not isinstance(s, np.ndarray)]
    argv = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
    tramp = ctypes.cast(getattr(lib, f"emu_tramp_{name}"), ctypes.c_void_p)
    message = ctypes.create_string_buffer(4096)
    rc = lib.emu_launch(tramp, argv, *(ctypes.c_uint(v) for v in (*grid, *block)),
                        ctypes.c_ulong(shared_mem), ctypes.c_ulong(smem_limit),
                        ctypes.c_ulonglong(seed), message,
                        ctypes.c_int(len(message)))
    if rc != 0:
        raise RuntimeError(f"{name}: {message.value.decode()}")
    return arrays


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(8)
        if len(header) < 8:
            return
        request = pickle.loads(stdin.read(struct.unpack("<Q", header)[0]))
        try:
            reply: tuple[bool, Any] = (True, launch(*request))
        except Exception as exc:  # reported to the parent, which raises it
            reply = (False, f"{type(exc).__name__}: {exc}")
        payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(struct.pack("<Q", len(payload)) + payload)
        stdout.flush()


if __name__ == "__main__":
    main()

"""Quantized weights kept in memory (int8 per output channel; q4 / q8 in blocks of 32, as GGUF's
Q4_0 / Q4_1 / Q8_0) and their linear layer: activations quantized per row on the fly, then the
compiled integer kernels of quant_gemm, split over the kernel threads.

The instruction set is chosen once, at import, from the CPU's features (AVX-512 VNNI, else
AVX2; the engine logs it at start-up); a CPU with neither cannot run the quantized formats
(QuantizationError).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from kvcore.kernels.cpu.quant_layout import BLOCK, TILE
from kvcore.kernels.cpu.threads import run_parallel, split

PAD_K = 64  # in_features are padded to a multiple of this (one VNNI step)

ISA_VNNI = np.zeros(0, np.uint16)  # the kernels' `isa` argument: its dtype picks the path
ISA_AVX2 = np.zeros(0, np.uint8)
ISA_NAMES: dict[str, np.ndarray] = {"avx512_vnni": ISA_VNNI, "avx2": ISA_AVX2}
FORMATS = ("int8", "q4", "q8")


class QuantizationError(ValueError):
    """A quantized format this CPU or this tensor cannot use."""


def cpu_isas() -> list[str]:
    """The integer dot-product paths the CPU has, best first."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return [name for name, wanted in (("avx512_vnni", ("avx512vnni", "avx512bw")),
                                      ("avx2", ("avx2",)))
            if all(features.get(f, False) for f in wanted)]


def cpu_isa() -> str | None:
    """The best integer dot-product path the CPU has: 'avx512_vnni', 'avx2' or None.
    $KVCORE_QUANT_ISA=avx2 forces the fallback (a path the CPU lacks is never taken)."""
    found = cpu_isas()
    forced = os.environ.get("KVCORE_QUANT_ISA")
    if forced:
        if forced not in ISA_NAMES:
            raise QuantizationError(f"KVCORE_QUANT_ISA must be one of {', '.join(ISA_NAMES)}, "
                                    f"got {forced!r}")
        if forced not in found:
            raise QuantizationError(f"KVCORE_QUANT_ISA={forced}: this CPU lacks it")
        return forced
    return found[0] if found else None


@functools.cache
def _isas() -> tuple[str | None, tuple[str, ...]]:
    """(the path the kernels run, every path the CPU has), checked once, on first use: importing
    this module (every model does) loads neither numba nor LLVM."""
    return cpu_isa(), tuple(cpu_isas())


def __getattr__(name: str) -> Any:
    """ISA: the path the kernels run (or None); AVAILABLE_ISAS: the paths the CPU has."""
    if name == "ISA":
        return _isas()[0]
    if name == "AVAILABLE_ISAS":
        return _isas()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """An (out_features, in_features) weight in a quantized format, rows padded to TILE and
    columns to PAD_K with zeros (the kernels have no tails).

    int8: q int8 (Np, Kp), scales (Np, 2) one per output row (twice: the kernel's pair read).
    q4: q uint8 (Np, Kp / 2) nibbles in GGUF's order (byte j of a block: weight j low, j + 16
    high), scales and mins (Np, Kp / 32) with weight = nibble x scale + min. q8: q int8 (Np,
    Kp), scales (Np, Kp / 32)."""

    format: str
    shape: tuple[int, int]  # (out_features, in_features), unpadded
    q: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None  # q4 only
    # int8 / q8: -128 x each block's scaled sum (Np, Kp / 32): undoes VNNI's a + 128
    offsets: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (self.q, self.scales, self.mins, self.offsets)
                   if x is not None)


def format_bytes(n: int, k: int, fmt: str) -> int:
    """Bytes an (n, k) weight holds in `fmt` (QuantizedWeight.nbytes without building it)."""
    rows, cols = padded(n, TILE), padded(k, PAD_K)
    blocks = rows * cols // BLOCK * 4  # one float32 per block of 32
    if fmt == "int8":
        return rows * cols + rows * 2 * 4 + blocks
    if fmt == "q4":
        return rows * cols // 2 + 2 * blocks
    if fmt == "q8":
        return rows * cols + 2 * blocks
    return n * k * 4


def with_corrections(weight: QuantizedWeight) -> QuantizedWeight:
    """The VNNI path sums (a + 128) q for signed q (int8, q8): keep -128 x each block's
    d x sum(q) to add back (times the activation block's scale); q4's nibbles are unsigned."""
    offsets = None
    if weight.format != "q4":
        sums = weight.q.reshape(weight.q.shape[0], -1, BLOCK).astype(np.float64).sum(axis=2)
        d = weight.scales[:, :1] if weight.format == "int8" else weight.scales
        offsets = (-128 * sums * d).astype(np.float32)
    return QuantizedWeight(weight.format, weight.shape, weight.q, weight.scales, weight.mins,
                           offsets)


def _pad(array: np.ndarray, rows: int, cols: int) -> np.ndarray:
    out = np.zeros((rows, cols), array.dtype)
    out[:array.shape[0], :array.shape[1]] = array
    return out


def quantize_int8(w: np.ndarray) -> QuantizedWeight:
    """(N, K) float -> int8, symmetric per output row: q = rint(w / s), s = max|w| / 127."""
    n, k = w.shape
    w64 = np.asarray(w, np.float64)
    scales = np.abs(w64).max(axis=1) / 127.0
    safe = np.where(scales > 0, scales, 1.0)
    q = np.rint(w64 / safe[:, None]).astype(np.int8)
    np_, kp = padded(n, TILE), padded(k, PAD_K)
    pair = np.repeat(scales[:, None], 2, axis=1).astype(np.float32)  # (N, 2)
    return with_corrections(QuantizedWeight("int8", (n, k), _pad(q, np_, kp), _pad(pair, np_, 2)))


def _blocked(w: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(N, K) -> (Np, Kp / 32, 32) float64, zero-padded."""
    n, k = w.shape
    np_, kp = padded(n, TILE), padded(k, PAD_K)
    return _pad(np.asarray(w, np.float64), np_, kp).reshape(np_, kp // BLOCK, BLOCK), n, k


def quantize_q4(w: np.ndarray) -> QuantizedWeight:
    """(N, K) float -> q4 with a min per block (GGUF's Q4_1 rule: d = (max - min) / 15,
    nibble = rint((w - min) / d))."""
    blocks, n, k = _blocked(w)
    low, high = blocks.min(axis=2), blocks.max(axis=2)
    d = (high - low) / 15.0
    safe = np.where(d > 0, d, 1.0)
    nibbles = np.clip(np.rint((blocks - low[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return pack_q4(nibbles, d.astype(np.float32), low.astype(np.float32), (n, k))


def pack_q4(nibbles: np.ndarray, d: np.ndarray, mins: np.ndarray,
            shape: tuple[int, int]) -> QuantizedWeight:
    """(Np, B, 32) nibble values 0..15 and (Np, B) scales / mins -> q4 in GGUF byte order."""
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # (Np, B, 16)
    return QuantizedWeight("q4", shape, packed.reshape(nibbles.shape[0], -1), d, mins)


def quantize_q8(w: np.ndarray) -> QuantizedWeight:
    """(N, K) float -> q8 blocks (GGUF's Q8_0 rule: d = max|w| / 127, q = rint(w / d))."""
    blocks, n, k = _blocked(w)
    d = np.abs(blocks).max(axis=2) / 127.0
    safe = np.where(d > 0, d, 1.0)
    q = np.rint(blocks / safe[..., None]).astype(np.int8)
    return with_corrections(QuantizedWeight("q8", (n, k), q.reshape(q.shape[0], -1),
                                             d.astype(np.float32)))


QUANTIZERS = {"int8": quantize_int8, "q4": quantize_q4, "q8": quantize_q8}


def concat_rows(parts: list[QuantizedWeight], order: np.ndarray | None = None) -> QuantizedWeight:
    """The weights' rows stacked (q, k and v fused; gate and up), optionally reordered (row
    `order[i]` of the stack becomes row i), without dequantizing."""
    fmt, k = parts[0].format, parts[0].shape[1]
    if any(p.format != fmt or p.shape[1] != k for p in parts):
        raise QuantizationError("concat_rows needs weights of one format and in_features")

    def rows(arrays: list[np.ndarray]) -> np.ndarray:
        stacked = np.concatenate([a[:p.shape[0]] for a, p in zip(arrays, parts, strict=True)])
        return stacked if order is None else stacked[order]

    q = rows([p.q for p in parts])
    n, np_ = q.shape[0], padded(q.shape[0], TILE)
    scales = rows([p.scales for p in parts])
    scales = _pad(scales, np_, scales.shape[1])
    mins = None if parts[0].mins is None else rows([p.mins for p in parts  # type: ignore[misc]
                                                    ])
    return with_corrections(QuantizedWeight(
        fmt, (n, k), _pad(q, np_, q.shape[1]), scales,
        None if mins is None else _pad(mins, np_, mins.shape[1])))


def dequantize_rows(weight: QuantizedWeight, rows: np.ndarray) -> np.ndarray:
    """weight[rows] as float32 (len(rows), in_features): the embedding's gather."""
    n, k = weight.shape
    q = weight.q[rows]
    if weight.format == "int8":
        return (q[:, :k] * weight.scales[rows][:, :1]).astype(np.float32)
    if weight.format == "q4":
        packed = q.reshape(len(rows), -1, 16)
        values = np.concatenate((packed & 15, packed >> 4), axis=2).astype(np.float32)
        out = values * weight.scales[rows][..., None]
        assert weight.mins is not None
        out += weight.mins[rows][..., None]
    else:
        out = q.reshape(len(rows), -1, BLOCK).astype(np.float32) * weight.scales[rows][..., None]
    return np.ascontiguousarray(out.reshape(len(rows), -1)[:, :k], dtype=np.float32)


def dequantize(weight: QuantizedWeight) -> np.ndarray:
    """The whole (out_features, in_features) weight as float32."""
    return dequantize_rows(weight, np.arange(weight.shape[0]))


_NO_TERMS = np.zeros((1, 1), np.float32)
MIN_SHARE_BYTES = 256 << 10


def linear(x: np.ndarray, weight: QuantizedWeight, isa: str | None = None) -> np.ndarray:
    """x (T, in_features) float32 @ weight.T -> (T, out_features) float32, x quantized to int8
    with a scale per block of 32 (symmetric). isa: the path to run (default: the CPU's best,
    chosen at import)."""
    from kvcore.kernels.cpu import quant_gemm

    best, available = _isas()
    isa = isa or best
    if isa is None:
        raise QuantizationError("quantized weights need a CPU with AVX2 or AVX-512 VNNI")
    if isa not in available:  # running it would fault on an illegal instruction
        raise QuantizationError(f"isa {isa!r}: this CPU has only {list(available)}")
    n, k = weight.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must have shape (T, {k}), got {x.shape}")
    tag = ISA_NAMES[isa]
    vnni = tag is ISA_VNNI
    rows = x.shape[0]
    kp = padded(k, PAD_K)
    a = np.empty((rows, kp), np.int8)  # (T, Kp)
    a_scales = np.empty((rows, kp // BLOCK), np.float32)  # (T, Kp / 32)
    block_sums = np.empty((rows, kp // BLOCK), np.float32)
    quant_gemm.quantize_rows(np.ascontiguousarray(x, dtype=np.float32), a, a_scales, block_sums,
                             vnni and weight.format == "q4")
    out = np.empty((rows, n), np.float32)  # (T, out_features)
    if rows == 0:
        return out
    terms, act_terms = _NO_TERMS, _NO_TERMS
    if weight.format == "q4":
        assert weight.mins is not None
        terms, act_terms = weight.mins, block_sums
    elif vnni:
        assert weight.offsets is not None
        terms, act_terms = weight.offsets, a_scales
    int8 = weight.format == "int8"
    kernel = partial(quant_gemm.block_rows, tag, a, a_scales, weight.q.reshape(-1),
                     weight.scales.reshape(-1), 2 if int8 else kp // BLOCK, 0 if int8 else 1,
                     terms, act_terms, terms is not _NO_TERMS, out)
    tile = TILE
    num_tiles = weight.q.shape[0] // tile
    # a thread's share must outweigh the hand-off (~0.1 ms on a 2-core VM): at least
    # MIN_SHARE_BYTES of weights x activation rows
    min_tiles = max(1, MIN_SHARE_BYTES // (weight.nbytes // num_tiles * rows))
    run_parallel(lambda part: kernel(part.start * tile, part.stop * tile),
                 split(num_tiles, min_tiles))
    return out


def warm_up(formats: tuple[str, ...] = FORMATS) -> None:
    """Load (or compile, on a machine's first start) the kernels of `formats` on the CPU's
    path before the engine takes requests: no JIT on a request."""
    x = np.ones((1, BLOCK), np.float32)
    for fmt in formats:
        linear(x, QUANTIZERS[fmt](np.ones((1, BLOCK), np.float32)))

"""How the host tier holds a page: the pool's own bytes (bit exact), or a lossy compression of
a float pool's page (int4: keys per channel over the block's tokens, values per token in groups
of 32 channels, as kvcore.cache.int4; fp8: e4m3 with one scale per array and page), which holds
2-4x more tokens per byte and restores close, not equal, values."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kvcore.cache.tiers.layout import PageLayout

FP8_MAX = 448.0  # e4m3fn's largest finite value
INT4_GROUP = 32
_FLOAT_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16),
                 "bf16": np.dtype(ml_dtypes.bfloat16)}


class PageCodec:
    """The pool's bytes as they are (the base class: encode copies, decode copies back)."""

    name = "auto"
    lossless = True

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout

    def payload_bytes(self) -> int:
        return self.layout.page_bytes

    def encode(self, pages: np.ndarray) -> list[np.ndarray]:
        """pages (n, page_bytes) uint8 -> n payloads, each its own array (evicted alone)."""
        return [np.array(page) for page in pages]

    def decode(self, payload: np.ndarray, out: np.ndarray) -> None:
        out[...] = payload


class _FloatCodec(PageCodec):
    lossless = False

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        if layout.block_shape is None or layout.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"kv_offload_dtype {self.name} compresses an fp32, fp16 or bf16 "
                             f"pool, not a {layout.dtype} one (use kv_offload_dtype auto)")
        self.dtype = _FLOAT_DTYPES[layout.dtype]
        self.num_arrays = len(layout.widths)

    def _values(self, pages: np.ndarray) -> np.ndarray:
        """(n, page_bytes) uint8 -> (n, arrays, block_size, heads, dim) float32."""
        assert self.layout.block_shape is not None
        shape = (len(pages), self.num_arrays, *self.layout.block_shape)
        return pages.view(self.dtype).reshape(shape).astype(np.float32)

    def _store(self, x: np.ndarray, out: np.ndarray) -> None:
        out.view(self.dtype)[...] = x.reshape(-1).astype(self.dtype)


class Fp8Codec(_FloatCodec):
    name = "fp8"

    def payload_bytes(self) -> int:
        return self.layout.page_bytes // self.dtype.itemsize + 4 * self.num_arrays

    def encode(self, pages: np.ndarray) -> list[np.ndarray]:
        x = self._values(pages)
        absmax = np.abs(np.nan_to_num(x)).max(axis=(2, 3, 4), keepdims=True)  # (n, A, 1, 1, 1)
        scale = np.where(absmax > 0, absmax / FP8_MAX, 1.0).astype(np.float32)
        q = np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        return [np.concatenate([q[i].reshape(-1).view(np.uint8),
                                scale[i].reshape(-1).view(np.uint8)]) for i in range(len(x))]

    def decode(self, payload: np.ndarray, out: np.ndarray) -> None:
        num = self.layout.page_bytes // self.dtype.itemsize
        assert self.layout.block_shape is not None
        q = payload[:num].view(ml_dtypes.float8_e4m3fn).reshape(self.num_arrays, -1)
        scale = payload[num:].view(np.float32).reshape(self.num_arrays, 1)
        self._store(q.astype(np.float32) * scale, out)


class Int4Codec(_FloatCodec):
    """Nibbles of every array, then fp16 (scale, zero) pairs: per channel over the block's
    tokens for K arrays, per token and group of channels for V arrays (MLA: all as K)."""

    name = "int4"

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        assert layout.block_shape is not None
        self.block_size, self.heads, self.dim = layout.block_shape
        self.group = math.gcd(INT4_GROUP, self.dim)
        if self.dim % 2:
            raise ValueError(f"kv_offload_dtype int4 needs an even head_dim, got {self.dim}")
        self.num_keys = self.num_arrays if layout.shared_kv else self.num_arrays // 2

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.layout.shared_kv:
            return x, x[:, :0]
        return x[:, 0::2], x[:, 1::2]

    def payload_bytes(self) -> int:
        bs, heads, dim = self.block_size, self.heads, self.dim
        num_values = self.num_arrays - self.num_keys
        nibbles = self.num_arrays * bs * heads * dim // 2
        params = 4 * (self.num_keys * heads * dim + num_values * bs * heads * dim // self.group)
        return nibbles + params

    def encode(self, pages: np.ndarray) -> list[np.ndarray]:
        keys, values = self._split(self._values(pages))  # (n, A', bs, H, D) each
        kq, kparams = _quantize(keys, axis=2)
        grouped = values.reshape(*values.shape[:-1], self.dim // self.group, self.group)
        vq, vparams = _quantize(grouped, axis=5)
        n = len(pages)
        return [np.concatenate([_pack(kq[i]), _pack(vq[i]), kparams[i].view(np.uint8).ravel(),
                                vparams[i].view(np.uint8).ravel()]) for i in range(n)]

    def decode(self, payload: np.ndarray, out: np.ndarray) -> None:
        bs, heads, dim, group = self.block_size, self.heads, self.dim, self.group
        num_values = self.num_arrays - self.num_keys
        kn = self.num_keys * bs * heads * dim // 2
        vn = num_values * bs * heads * dim // 2
        kp = 4 * self.num_keys * heads * dim
        k = _unpack(payload[:kn]).reshape(self.num_keys, bs, heads, dim)
        v = _unpack(payload[kn:kn + vn]).reshape(num_values, bs, heads, dim // group, group)
        kparams = payload[kn + vn:kn + vn + kp].view(np.float16).astype(np.float32).reshape(
            2, self.num_keys, 1, heads, dim)
        vparams = payload[kn + vn + kp:].view(np.float16).astype(np.float32).reshape(
            2, num_values, bs, heads, dim // group, 1)
        keys = kparams[1] + kparams[0] * k
        values = (vparams[1] + vparams[0] * v).reshape(num_values, bs, heads, dim)
        if self.layout.shared_kv:
            x = keys
        else:
            x = np.empty((self.num_arrays, bs, heads, dim), np.float32)
            x[0::2], x[1::2] = keys, values
        self._store(x, out)


def _quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """q uint8 (x's shape) and params (2, ...) fp16 = (scale, zero) of groups along `axis`,
    as kvcore.cache.int4 quantizes (min as zero, (max - min) / 15 as scale, round half up)."""
    x = np.clip(np.nan_to_num(x, nan=0.0, posinf=65504.0, neginf=-65504.0), -65504.0, 65504.0)
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True)
    zero = lo.astype(np.float16)
    scale = ((hi - lo) / np.float32(15)).astype(np.float16)
    s32, z32 = scale.astype(np.float32), zero.astype(np.float32)
    q = np.floor((x - z32) / np.where(s32 == 0, np.float32(1), s32) + np.float32(0.5))
    q = np.where(s32 == 0, np.float32(0), np.clip(q, 0, 15)).astype(np.uint8)
    params = np.stack([scale.squeeze(axis), zero.squeeze(axis)], axis=1)  # (n, 2, ...)
    return q, params


def _pack(q: np.ndarray) -> np.ndarray:
    flat = q.reshape(-1)
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def _unpack(nibbles: np.ndarray) -> np.ndarray:
    out = np.empty(nibbles.size * 2, np.float32)
    out[0::2], out[1::2] = nibbles & 0xF, nibbles >> 4
    return out


def make_codec(name: str, layout: PageLayout) -> PageCodec:
    """The host tier's codec for TierConfig.kv_offload_dtype (ValueError for a pool it cannot
    compress)."""
    if name == "auto":
        return PageCodec(layout)
    if name == "int4":
        return Int4Codec(layout)
    if name == "fp8":
        return Fp8Codec(layout)
    raise ValueError(f"kv_offload_dtype must be auto, int4 or fp8, got {name!r}")

"""The disk tier's page file: a fixed header naming the model (its fingerprint) and the block
(its chain hash and token ids), a CRC-32 over header and payload, then the page's bytes.

    magic b"KVCPAGE\\0" | version u16 | flags u16 | fingerprint 32 B | chain hash 32 B |
    num_tokens u32 | payload_len u64 | token ids num_tokens x int64 | crc32 u32 | payload

Little-endian. The fingerprint hashes the weights, the layer / head shapes, the KV dtype (and
fp8 scales), the block size and the page layout, so a page of another model, dtype or block
size is never taken for this one's.
"""

from __future__ import annotations

import struct
import zlib
from io import BufferedIOBase

import numpy as np

MAGIC = b"KVCPAGE\0"
VERSION = 1
_PREFIX = struct.Struct("<8sHH32s32sIQ")
_CRC = struct.Struct("<I")


class PageFileError(ValueError):
    """A page file that must not be loaded (truncated, corrupt, another model's or block's)."""


def header_bytes(block_size: int) -> int:
    return _PREFIX.size + 8 * block_size + _CRC.size


def file_bytes(block_size: int, page_bytes: int) -> int:
    return header_bytes(block_size) + page_bytes


def encode_header(fingerprint: bytes, block_hash: bytes, token_bytes: bytes,
                  payload: np.ndarray) -> bytes:
    """The header (crc included) of a page file whose payload follows it."""
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, fingerprint, block_hash, len(token_bytes) // 8,
                          payload.nbytes) + token_bytes
    crc = zlib.crc32(payload.data.cast("B"), zlib.crc32(prefix))
    return prefix + _CRC.pack(crc)


def read_page(f: BufferedIOBase, fingerprint: bytes, block_hash: bytes, token_bytes: bytes,
              out: np.ndarray) -> None:
    """Read and check one page file into out (page_bytes,) uint8 (written in place, maybe in
    part, before a PageFileError says it must not be used)."""
    num_tokens = len(token_bytes) // 8
    header = f.read(_PREFIX.size + len(token_bytes) + _CRC.size)
    if len(header) != _PREFIX.size + len(token_bytes) + _CRC.size:
        raise PageFileError("truncated header")
    magic, version, _, file_fp, file_hash, file_tokens, payload_len = _PREFIX.unpack_from(header)
    if magic != MAGIC or version != VERSION:
        raise PageFileError("not a kvcore page file of this version")
    if file_fp != fingerprint:
        raise PageFileError("another model's page (fingerprint differs)")
    if file_hash != block_hash or file_tokens != num_tokens or payload_len != out.nbytes:
        raise PageFileError("another block's page (hash, tokens or size differ)")
    if header[_PREFIX.size:_PREFIX.size + len(token_bytes)] != token_bytes:
        raise PageFileError("the page holds other token ids")
    view = out.data.cast("B")
    if f.readinto(view) != out.nbytes or f.read(1):
        raise PageFileError("truncated or oversized payload")
    (crc,) = _CRC.unpack_from(header, _PREFIX.size + len(token_bytes))
    if zlib.crc32(view, zlib.crc32(header[:_PREFIX.size + len(token_bytes)])) != crc:
        raise PageFileError("checksum mismatch")

"""The disk tier: one page file per block in a directory, written atomically (a temporary file
then a rename), least recently used out first under a byte budget.

Files live under `<dir>/<fingerprint prefix>/<first hash byte>/<chain hash>.kvpage`, so models
sharing a directory never meet, and replicas of one model on one node share their pages: each
writes its own temporary file and renames it into place (the last rename wins; both hold the
same block), and a page another replica wrote is found by its name. A file that is truncated,
corrupt or another model's is removed, never loaded. An error writing (a full disk, a directory
that cannot be written) turns the tier off with one warning; serving goes on without it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import structlog

from kvcore.cache.block_pool import BlockHash
from kvcore.cache.tiers import pagefile

log = structlog.get_logger(__name__)
SUFFIX = ".kvpage"
STALE_TEMP_S = 600.0  # a temporary file this old is a crashed writer's (removed at start)


class DiskTier:
    """Thread-safe: the engine step looks pages up, the tier's writer writes them, its loader
    reads them."""

    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, fingerprint: bytes,
                 page_bytes: int, block_size: int) -> None:
        self.fingerprint = fingerprint
        self.page_bytes = page_bytes
        self.block_size = block_size
        self.file_bytes = pagefile.file_bytes(block_size, page_bytes)
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"kv_tier_disk_size ({capacity_bytes} bytes) holds no page file "
                             f"of {self.file_bytes} bytes")
        self.capacity_bytes = capacity_bytes
        self.dir = Path(root) / fingerprint.hex()[:32]
        self._index: OrderedDict[BlockHash, None] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()
        self._subdirs: set[str] = set()
        self.enabled = True
        self.num_removed_bad = 0  # truncated, corrupt or foreign files removed
        self.num_evicted = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{uuid.uuid4().hex}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self.disable(e)
            return
        self._scan()

    @property
    def num_pages(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    def disable(self, error: OSError) -> None:
        """Turn the tier off (once, with one warning): pages are neither written nor read."""
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
            self._index.clear()
        log.warning("kv tier disabled", tier="disk", dir=str(self.dir),
                    error=f"{type(error).__name__}: {error}")

    def _path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Index this model's page files, oldest modification first; remove files of the wrong
        size (truncated) and temporary files left by a crashed writer."""
        found: list[tuple[float, BlockHash]] = []
        now = time.time()
        for sub in os.scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    stat = entry.stat(follow_symlinks=False)
                    if entry.name.endswith(".tmp"):
                        if now - stat.st_mtime > STALE_TEMP_S:
                            os.unlink(entry.path)
                        continue
                    block_hash = _hash_of(entry.name)
                    if block_hash is None or stat.st_size != self.file_bytes:
                        os.unlink(entry.path)
                        self.num_removed_bad += 1
                        continue
                except OSError:
                    continue  # another replica removed it meanwhile
                found.append((stat.st_mtime, block_hash))
        for _, block_hash in sorted(found):
            self._index[block_hash] = None
        self._evict_over_budget()

    def __contains__(self, block_hash: object) -> bool:
        if not self.enabled or not isinstance(block_hash, bytes):
            return False
        if block_hash in self._index:
            return True
        if os.path.exists(self._path(block_hash)):  # written by another replica
            with self._lock:
                self._index[block_hash] = None
                self._index.move_to_end(block_hash, last=False)  # its age is unknown: old
            return True
        return False

    def put(self, keys: list[tuple[BlockHash, bytes]], pages: np.ndarray) -> int:
        """Write pages (n, page_bytes) uint8 not on disk yet; returns how many were written."""
        written = 0
        for (block_hash, token_bytes), page in zip(keys, pages, strict=True):
            if not self.enabled:
                break
            if block_hash in self._index:
                with self._lock:
                    if block_hash in self._index:
                        self._index.move_to_end(block_hash)
                continue
            if self._write(block_hash, token_bytes, page):
                written += 1
        return written

    def _write(self, block_hash: BlockHash, token_bytes: bytes, page: np.ndarray) -> bool:
        path = self._path(block_hash)
        temp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            if path.parent.name not in self._subdirs:
                path.parent.mkdir(exist_ok=True)
                self._subdirs.add(path.parent.name)
            with open(temp, "wb") as f:
                f.write(pagefile.encode_header(self.fingerprint, block_hash, token_bytes, page))
                f.write(page.data.cast("B"))
            os.replace(temp, path)  # atomic: readers see the old file, the new one, or none
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            self.disable(e)
            return False
        with self._lock:
            self._index[block_hash] = None
            self._index.move_to_end(block_hash)
        self._evict_over_budget()
        return True

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if len(self._index) * self.file_bytes <= self.capacity_bytes or not self._index:
                    return
                block_hash, _ = self._index.popitem(last=False)
            with contextlib.suppress(OSError):
                os.unlink(self._path(block_hash))
            self.num_evicted += 1

    def get(self, block_hash: BlockHash, token_bytes: bytes, out: np.ndarray) -> bool:
        """Read the page into out (page_bytes,) uint8; False when it is missing or must not be
        used (a bad file is removed)."""
        if not self.enabled:
            return False
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                pagefile.read_page(f, self.fingerprint, block_hash, token_bytes, out)
        except pagefile.PageFileError as e:
            log.warning("kv tier page removed", tier="disk", file=path.name, reason=str(e))
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.num_removed_bad += 1
            self._forget(block_hash)
            return False
        except OSError:  # removed meanwhile (another replica's eviction)
            self._forget(block_hash)
            return False
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
        return True

    def _forget(self, block_hash: BlockHash) -> None:
        with self._lock:
            self._index.pop(block_hash, None)


def _hash_of(name: str) -> BlockHash | None:
    if not name.endswith(SUFFIX) or len(name) != 64 + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:64])
    except ValueError:
        return None



def shared_secret(root: str | Path) -> bytes | None:
    """The secret every server using this tier directory derives its tenants' cache salts
    from (`root/salt.secret`, 32 random bytes made once, readable by its owner only): chain
    hashes, and so page names, must be the same after a restart and in every replica sharing
    the directory. None when the directory cannot hold it (the disk tier is then off too)."""
    path = Path(root) / "salt.secret"
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        if not path.exists():
            temp = path.with_name(f".salt.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(temp, path)  # atomic and exclusive: the first server's secret wins
            except FileExistsError:
                pass
            finally:
                os.unlink(temp)
        secret = path.read_bytes()
    except OSError:
        return None
    return secret if len(secret) == 32 else None

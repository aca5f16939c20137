"""The disk tier: page files named by the salted chain hash, written atomically, checked on every
read (a truncated, corrupt or foreign file is removed, never loaded), LRU under a byte budget,
found again after a restart and by another replica; a full disk or an unwritable directory
turns it off with one warning."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import structlog

from kvcore.cache import chain_hashes
from kvcore.cache.tiers import DiskTier, pagefile
from kvcore.planner import PAGE_FILE_FIXED_BYTES

BS, PAGE = 4, 96
FP = bytes(range(32))


def page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


def key(i: int, salt: str | None = None) -> tuple[bytes, bytes]:
    tokens = [i, i + 1, i + 2, i + 3]
    return chain_hashes(tokens, BS, salt)[0], np.asarray(tokens, "<i8").tobytes()


def tier(root: Path, capacity: int = 1 << 20, fingerprint: bytes = FP) -> DiskTier:
    return DiskTier(root, capacity, fingerprint, PAGE, BS)


def files(t: DiskTier) -> list[Path]:
    return sorted(p for p in t.dir.rglob("*") if p.is_file())


def read(t: DiskTier, k: tuple[bytes, bytes]) -> np.ndarray | None:
    out = np.zeros(PAGE, np.uint8)
    return out if t.get(k[0], k[1], out) else None


def test_pages_round_trip_bit_exact_in_one_atomically_written_file_each(tmp_path: Path) -> None:
    t = tier(tmp_path)
    assert t.put([key(1), key(2)], np.stack([page(1), page(2)])) == 2
    assert t.put([key(1)], page(1)[None]) == 0  # already there: not written twice
    paths = files(t)
    assert [p.name for p in paths] == sorted(k[0].hex() + ".kvpage" for k in (key(1), key(2)))
    assert all(p.stat().st_size == t.file_bytes for p in paths)  # no temporary file left
    assert t.file_bytes == PAGE_FILE_FIXED_BYTES + 8 * BS + PAGE
    got = read(t, key(2))
    assert got is not None and got.tobytes() == page(2).tobytes()
    assert key(1)[0] in t and key(3)[0] not in t and read(t, key(3)) is None


def test_a_salt_never_finds_another_tenants_page_on_disk(tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.put([key(1, "tenant-a")], page(1)[None])
    assert key(1, "tenant-a")[0] in t
    assert key(1, "tenant-b")[0] not in t and key(1)[0] not in t
    assert read(t, key(1, "tenant-b")) is None
    # the right name with other token ids in the file is refused too (and removed)
    hash_a, _ = key(1, "tenant-a")
    assert not t.get(hash_a, key(5)[1], np.zeros(PAGE, np.uint8))
    assert hash_a not in t and not files(t)


def corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:-7]))
    elif how == "flipped":
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    elif how == "header":
        data[0:8] = b"NOTAPAGE"
        path.write_bytes(bytes(data))
    elif how == "longer":
        path.write_bytes(bytes(data) + b"x")


@pytest.mark.parametrize("how", ["truncated", "flipped", "header", "longer"])
def test_a_bad_file_is_removed_never_loaded(tmp_path: Path, how: str) -> None:
    t = tier(tmp_path)
    t.put([key(1)], page(1)[None])
    (path,) = files(t)
    corrupt(path, how)
    assert read(t, key(1)) is None
    assert not path.exists() and key(1)[0] not in t and t.num_removed_bad == 1


def test_another_models_page_is_removed_never_loaded(tmp_path: Path) -> None:
    mine, other = tier(tmp_path), tier(tmp_path, fingerprint=bytes(32))
    assert mine.dir != other.dir  # models sharing a directory never meet
    other.put([key(1)], page(1)[None])
    (foreign,) = files(other)
    target = mine.dir / foreign.parent.name / foreign.name  # as if copied into mine
    target.parent.mkdir(parents=True)
    target.write_bytes(foreign.read_bytes())
    assert key(1)[0] in mine  # found by name ...
    assert read(mine, key(1)) is None and not target.exists()  # ... refused by its header
    assert foreign.exists()  # the other model's own page stays


def test_restart_finds_pages_and_drops_truncated_files_and_stale_temporaries(
        tmp_path: Path) -> None:
    t = tier(tmp_path)
    t.put([key(i) for i in range(3)], np.stack([page(i) for i in range(3)]))
    paths = {p.name: p for p in files(t)}
    corrupt(paths[key(2)[0].hex() + ".kvpage"], "truncated")
    stale = t.dir / "00" / ".x.kvpage.1.abc.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))  # long ago: a crashed writer's
    again = tier(tmp_path)
    assert again.num_pages == 2 and again.num_removed_bad == 1 and not stale.exists()
    got = read(again, key(1))
    assert got is not None and got.tobytes() == page(1).tobytes()


def test_least_recently_used_files_go_first_under_the_budget(tmp_path: Path) -> None:
    t = tier(tmp_path, capacity=3 * (PAGE_FILE_FIXED_BYTES + 8 * BS + PAGE))
    for i in range(3):
        t.put([key(i)], page(i)[None])
    assert read(t, key(0)) is not None  # used: key(1) is the oldest now
    t.put([key(3)], page(3)[None])
    assert [key(i)[0] in t for i in range(4)] == [True, False, True, True]
    assert len(files(t)) == 3 and t.num_evicted == 1
    assert t.num_bytes <= t.capacity_bytes


def test_an_unwritable_directory_turns_the_tier_off_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    with structlog.testing.capture_logs() as logs:
        t = tier(blocker)
        assert not t.enabled and t.put([key(1)], page(1)[None]) == 0
        assert key(1)[0] not in t and read(t, key(1)) is None
    assert [e["event"] for e in logs] == ["kv tier disabled"]


def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    t = tier(tmp_path)
    t.put([key(1)], page(1)[None])

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("kvcore.cache.tiers.disk.os.replace", full)
    with structlog.testing.capture_logs() as logs:
        assert t.put([key(2), key(3)], np.stack([page(2), page(3)])) == 0
        assert t.put([key(4)], page(4)[None]) == 0
    assert [e["event"] for e in logs] == ["kv tier disabled"]
    assert "ENOSPC" in logs[0]["error"] or "No space" in logs[0]["error"]
    assert not t.enabled and key(1)[0] not in t
    assert not [p for p in t.dir.rglob("*.tmp")]  # the half-written temporary is gone


def test_two_replicas_share_one_directory_safely(tmp_path: Path) -> None:
    a, b = tier(tmp_path), tier(tmp_path)
    keys = [key(i) for i in range(40)]
    pages = np.stack([page(i) for i in range(40)])

    def write(t: DiskTier, order: list[int]) -> None:
        for i in order:
            t.put([keys[i]], pages[i:i + 1])
    # concurrent writers of overlapping pages: each renames its own temporary into place
    threads = [threading.Thread(target=write, args=(a, list(range(40)))),
               threading.Thread(target=write, args=(b, list(range(39, -1, -1))))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(files(a)) == 40 and not list(a.dir.rglob("*.tmp"))
    fresh = tier(tmp_path)
    for t in (a, b, fresh):
        for i in (0, 17, 39):
            got = read(t, keys[i])
            assert got is not None and got.tobytes() == pages[i].tobytes()
    # a page only one replica wrote is found by the other, by its name
    a.put([key(99)], page(99)[None])
    got = read(b, key(99))
    assert key(99)[0] in b and got is not None and got.tobytes() == page(99).tobytes()


def test_the_header_names_the_model_and_the_block() -> None:
    payload = page(1)
    header = pagefile.encode_header(FP, key(1)[0], key(1)[1], payload)
    assert len(header) == pagefile.header_bytes(BS) == PAGE_FILE_FIXED_BYTES + 8 * BS
    assert header.startswith(pagefile.MAGIC) and FP in header and key(1)[0] in header

"""Every byte of a big file crosses (#attack: a 2 GiB+ file cut by `migrate --repoint`, then
its source deleted): a short read is read on, never taken for the end of the file; copies,
hashes and comparisons stream in bounded memory and read both files to the end; a source cut
during its copy is never published.

Linux returns at most 0x7ffff000 bytes per read; FUSE and NFS return fewer. A regular file
that reads short cannot be made cheaply (2 GiB of disk, or a FUSE mount), and a pipe or
socket is refused as "not a regular file" before any read, so `os.read` is capped here: the
one mock, for the error path a real part cannot produce cheaply. Everything else is real."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError
from prefixreg.registry import fsutil, treecopy
from prefixreg.registry.migrate import migrate_registry
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.test_migrate_seed import build_seed

CHUNK = fsutil.CHUNK
TAIL = b"THE-END-OF-THE-FILE"


@pytest.fixture
def short_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """`os.read` returns at most 4093 bytes a call (what a big file, FUSE or NFS does); the
    sizes asked of it, to show the reads were short."""
    real, asked = os.read, []

    def capped(fd: int, n: int) -> bytes:
        asked.append(n)
        return real(fd, min(n, 4093))

    monkeypatch.setattr(os, "read", capped)
    return asked


def _print(data: bytes) -> tuple[int, str, bytes]:
    """What a file's bytes are compared by (a failure names sizes and tails, not MiBs)."""
    return len(data), hashlib.sha256(data).hexdigest(), data[-len(TAIL) :]


def _big(path: Path, size: int) -> bytes:
    data = (hashlib.sha256(path.name.encode()).digest() * (size // 32 + 1))[: size - len(TAIL)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data + TAIL)
    return data + TAIL


def test_copy_hash_compare_and_reads_get_every_byte_through_short_reads(
    tmp_path: Path, short_reads: list[int]
) -> None:
    src_root, dst_root = tmp_path / "src", tmp_path / "dst"
    data = _big(src_root / "kv" / "big.bin", 3 * CHUNK + 4567)
    (dst_root / "kv").mkdir(parents=True)
    src, dst = src_root / "kv" / "big.bin", dst_root / "kv" / "big.bin"
    digest = fsutil.copy_durable(src, dst, root=src_root)
    assert digest == hashlib.sha256(data).hexdigest()
    assert _print(dst.read_bytes()) == _print(data)
    treecopy.check_copies(dst_root, {"kv/big.bin": digest})  # reads all of the copy
    assert treecopy.sha256_file(src, src_root) == digest
    assert treecopy.compare(src, dst, root=src_root, their_root=dst_root) == "same"
    assert _print(fsutil.read_nofollow(src, root=src_root)) == _print(data)
    assert _print(fsutil.read_below(str(src_root), "kv/big.bin")) == _print(data)
    # A copy cut short, or one whose last byte differs, is told apart from the source.
    dst.chmod(0o644)
    dst.write_bytes(data[:-1])
    assert treecopy.compare(src, dst, root=src_root, their_root=dst_root) == "prefix"
    with pytest.raises(IntegrityError, match="copy hashes to"):
        treecopy.check_copies(dst_root, {"kv/big.bin": digest})
    dst.write_bytes(data[:-1] + b"?")
    assert treecopy.compare(src, dst, root=src_root, their_root=dst_root) == "differs"
    assert max(short_reads) > 4093  # the reads asked for more than they got


def test_an_object_past_a_short_read_is_read_whole_and_verified(
    tmp_path: Path, short_reads: list[int]
) -> None:
    reg = Registry(tmp_path / "reg")
    content = b"a long prefix line\n" * (2 * CHUNK // 19 + 7)
    sha = reg.add(content, name="long")
    assert _print(reg.read_verified(sha)) == _print(content)
    assert _print(reg.get("long").data) == _print(content)
    assert verify_registry(reg).ok
    assert max(short_reads) > 4093


def test_repoint_moves_every_byte_of_a_big_file_before_the_source_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, short_reads: list[int]
) -> None:
    """The attack's case: a hand-built registry holding `kv/big.bin`; the old code copied
    its first read, compared it by its first read, verified ok and removed the source."""
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    seed, _shas = build_seed(home)
    data = _big(seed / "kv" / "big.bin", 2 * CHUNK + 19)
    target = tmp_path / "adopted"
    report = migrate_registry(seed, target, repoint=True)
    assert report.kept == ["bin", "kv"]
    assert not seed.exists()
    assert _print((target / "kv" / "big.bin").read_bytes()) == _print(data)
    assert verify_registry(Registry(target)).ok


def test_a_copy_bigger_than_a_chunk_is_identical_and_streamed_in_bounded_memory(
    tmp_path: Path,
) -> None:
    src_root, dst_root = tmp_path / "src", tmp_path / "dst"
    data = _big(src_root / "big.bin", 24 * CHUNK + 3)
    src, dst = src_root / "big.bin", dst_root / "big.bin"
    src.chmod(0o640)
    os.utime(src, ns=(1_700_000_000_123_456_789, 1_600_000_000_987_654_321))
    dst_root.mkdir()
    tracemalloc.start()
    try:
        digest = fsutil.copy_durable(src, dst, root=src_root)
        treecopy.check_copies(dst_root, {"big.bin": digest})
        relation = treecopy.compare(src, dst, root=src_root, their_root=dst_root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # A chunk or two at each end at a time, whatever the size (the old copy held it all).
    assert peak < 6 * CHUNK, f"{peak:,} bytes held to copy and compare {len(data):,}"
    assert relation == "same" and digest == hashlib.sha256(data).hexdigest()
    assert _print(dst.read_bytes()) == _print(data)
    got = dst.stat()
    assert (got.st_mode & 0o7777, got.st_mtime_ns) == (0o640, 1_600_000_000_987_654_321)


def test_a_source_cut_during_its_copy_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer truncates the source after the copy opened it (the truncation is real; the
    hook only times it): the copy ends short of the size it was opened with."""
    src_root, dst_root = tmp_path / "src", tmp_path / "dst"
    _big(src_root / "big.bin", 2 * CHUNK + 5)
    src, dst = src_root / "big.bin", dst_root / "big.bin"
    dst_root.mkdir()
    real = os.read

    def cut_first(fd: int, n: int) -> bytes:
        if os.fstat(fd).st_ino == src.stat().st_ino and os.fstat(fd).st_size > CHUNK:
            os.truncate(src, CHUNK // 2)
        return real(fd, n)

    monkeypatch.setattr(os, "read", cut_first)
    with pytest.raises(IntegrityError, match=f"read {CHUNK // 2:,} of its {2 * CHUNK + 5:,}"):
        fsutil.copy_durable(src, dst, root=src_root)
    assert list(dst_root.iterdir()) == []  # no copy, no temp file

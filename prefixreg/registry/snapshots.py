"""Snapshot records on disk (`snapshots/<sha256>-<build>.json`), and hashing a snapshot file.

Invariants:
- The record path comes from `layout.snapshot_filename` only; a record whose content names
  another prefix or build than its file name is refused (`CorruptRecordError`), so a record
  cannot be moved to stand for another prefix.
- Writes are durable (`fsutil.replace_atomic`: temp file, fsync, rename, directory fsync):
  saving the same prefix on the same build again replaces its record whole. A mirror is
  never written (the next mirror run would delete it).
- Nothing is followed through a symlink: reads open every component below the root with
  `O_NOFOLLOW`, writes refuse a symlinked `snapshots/`, and a snapshot file is hashed
  through a no-follow descriptor that must be a regular file.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Final, NamedTuple

from prefixreg.core.errors import CorruptRecordError, IntegrityError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.core.snapshots import SnapshotRecord, validate_file_name
from prefixreg.registry import fsutil
from prefixreg.registry.layout import SNAPSHOTS, snapshot_filename
from prefixreg.registry.store import Registry

__all__ = [
    "FileDigests",
    "digest_snapshot_file",
    "hash_snapshot_file",
    "list_snapshots",
    "read_snapshot",
    "snapshot_record_path",
    "write_snapshot",
]

_CHUNK: Final = 1 << 20


def snapshot_record_path(registry: Registry, sha256: str, build_id: str) -> Path:
    """Where the record of `sha256` on `build_id` lives (whether or not it exists)."""
    return registry.root / SNAPSHOTS / snapshot_filename(sha256, build_id)


def write_snapshot(registry: Registry, record: SnapshotRecord) -> Path:
    """Write (or replace) the record of `record.sha256` on its build; returns its path.

    Raises:
        UsageError: the registry is a mirror.
        IntegrityError: `snapshots/` is a symlink or not a directory.
    """
    registry.init()
    registry.refuse_on_mirror("write a snapshot record")
    directory = registry.root / SNAPSHOTS
    fsutil.check_no_symlinks(registry.root, directory)
    directory.mkdir(exist_ok=True)
    path = directory / snapshot_filename(record.sha256, record.build_id)
    fsutil.replace_atomic(path, dumps_canonical(record.to_dict()) + b"\n", mode=0o644)
    return path


def _load(registry: Registry, path: Path) -> SnapshotRecord:
    try:
        raw = fsutil.read_nofollow(path, root=registry.root)
        record = SnapshotRecord.from_dict(loads_object(raw, path=path))
    except CorruptRecordError as exc:
        raise CorruptRecordError(f"{path}: {exc}", path=path) from None
    if path.name != snapshot_filename(record.sha256, record.build_id):
        raise CorruptRecordError(
            f"{path}: records prefix {record.sha256[:12]} on build {record.build_id}", path=path
        )
    return record


def read_snapshot(registry: Registry, sha256: str, build_id: str) -> SnapshotRecord | None:
    """The record of `sha256` on `build_id`, or None when there is none.

    Raises:
        CorruptRecordError: the record does not parse or names another prefix or build.
        IntegrityError: the record (or `snapshots/`) is a symlink.
    """
    path = snapshot_record_path(registry, sha256, build_id)
    try:
        return _load(registry, path)
    except FileNotFoundError:
        return None


def list_snapshots(registry: Registry, sha256: str | None = None) -> list[SnapshotRecord]:
    """Every snapshot record (of one prefix, or all), oldest first.

    Raises:
        CorruptRecordError: a record that does not parse (fail closed).
        IntegrityError: `snapshots/` is a symlink.
    """
    directory = registry.root / SNAPSHOTS
    try:
        st = directory.lstat()
    except FileNotFoundError:
        return []
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise IntegrityError(f"{directory}: not a directory (a symlink?); refused", path=directory)
    pattern = f"{sha256}-*.json" if sha256 is not None else "*.json"
    out = [
        _load(registry, path)
        for path in sorted(directory.glob(pattern))
        if not fsutil.is_temp_name(path.name)
    ]
    out.sort(key=lambda r: (r.created, r.sha256, r.build_id))
    return out


class FileDigests(NamedTuple):
    """Digests of one snapshot file (None: not computed) and its size in bytes."""

    sha256: str | None
    blake3: str | None
    size: int


def digest_snapshot_file(
    directory: Path | str, name: str, *, sha256: bool = True, blake3: bool = True
) -> FileDigests:
    """Hash the snapshot file `name` in the server's directory `directory`, in one pass.

    The file is opened with `O_NOFOLLOW` and must be a regular file: a symlink planted where
    a snapshot should be is refused, never hashed through.

    Raises:
        FileNotFoundError: no such file. IntegrityError: a symlink or not a regular file.
    """
    import blake3 as b3  # native, imported only where a snapshot file is hashed

    path = Path(directory) / validate_file_name(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise IntegrityError(
            f"{path}: cannot open without following links ({exc.strerror})", path=path
        ) from None
    sha = hashlib.sha256() if sha256 else None
    fast = b3.blake3() if blake3 else None
    size = 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IntegrityError(f"{path}: not a regular file; refused", path=path)
        while chunk := os.read(fd, _CHUNK):
            size += len(chunk)
            if sha is not None:
                sha.update(chunk)
            if fast is not None:
                fast.update(chunk)
    finally:
        os.close(fd)
    return FileDigests(
        sha256=None if sha is None else sha.hexdigest(),
        blake3=None if fast is None else fast.hexdigest(),
        size=size,
    )


def hash_snapshot_file(directory: Path | str, name: str) -> tuple[str, int]:
    """(sha256, size) of a snapshot file (see `digest_snapshot_file`)."""
    got = digest_snapshot_file(directory, name, blake3=False)
    assert got.sha256 is not None  # noqa: S101 -- asked for
    return got.sha256, got.size

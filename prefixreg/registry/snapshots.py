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
- For `verify` and `gc`: a record keeps its prefix object as a name does
  (`snapshot_prefix_shas`, read from the record *file names*, so even a record that no
  longer parses keeps its prefix); a record is removed only by `prune_snapshot_records`
  (gc `--prune-snapshots`), and only when its prefix object is gone and the record is
  older than the cutoff. Snapshot files live in the server's directory, outside the
  registry, and are never touched here.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path
from typing import Final, NamedTuple

from prefixreg.core.errors import CorruptRecordError, IntegrityError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.core.snapshots import SnapshotRecord, validate_file_name
from prefixreg.registry import fsutil
from prefixreg.registry.layout import SNAPSHOTS, frame_relpath, object_relpath, snapshot_filename
from prefixreg.registry.store import Registry

__all__ = [
    "FileDigests",
    "check_snapshot_entry",
    "digest_snapshot_file",
    "hash_snapshot_file",
    "list_snapshots",
    "prune_snapshot_records",
    "read_snapshot",
    "snapshot_prefix_shas",
    "snapshot_record_path",
    "write_snapshot",
]

_CHUNK: Final = 1 << 20
_RECORD_NAME: Final = re.compile(r"([0-9a-f]{64})-[0-9a-f]{16}\.json")


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
    directory = registry.writable_dir(SNAPSHOTS)  # created durably, never through a link
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


# -- verify and gc --------------------------------------------------------------------------


def _record_entries(registry: Registry) -> list[tuple[str, str]]:
    """(file name, prefix sha) of every entry of `snapshots/` named like a record."""
    out = []
    for name, kind in registry.entries(SNAPSHOTS):
        match = _RECORD_NAME.fullmatch(name)
        if kind == "file" and match is not None:
            out.append((name, match.group(1)))
    return out


def _head_missing(registry: Registry, sha: str) -> bool:
    """Neither a prefix object nor a frame record has this sha (a record's head is either)."""
    return all(registry.lstat(rel(sha)) is None for rel in (object_relpath, frame_relpath))


def snapshot_prefix_shas(registry: Registry) -> set[str]:
    """The prefixes snapshot records point to (by file name: parsed or not, each keeps its
    prefix from `gc --prune-unnamed`, as a name does).

    Raises:
        IntegrityError: `snapshots/` is a symlink or not a directory.
    """
    return {sha for _name, sha in _record_entries(registry)}


def check_snapshot_entry(registry: Registry, name: str, kind: str) -> list[tuple[str, str]]:
    """`verify`'s findings for the entry `name` of `snapshots/`, as (kind, message) pairs.

    `unexpected`: not a record file or name; `bad_record`: does not parse strictly, or names
    another prefix or build than its file name; `dangling`: its prefix object is missing.
    """
    match = _RECORD_NAME.fullmatch(name)
    if kind != "file" or match is None:
        return [("unexpected", "not a snapshot record (<sha256>-<build id>.json)")]
    try:
        record = _load(registry, registry.root / SNAPSHOTS / name)
    except (CorruptRecordError, IntegrityError) as exc:
        return [("bad_record", str(exc))]
    try:
        missing = _head_missing(registry, record.sha256)
    except IntegrityError:
        return []  # behind a symlinked objects/: the walk reports it
    if missing:
        return [("dangling", f"snapshot record of missing prefix {record.sha256}")]
    return []


def prune_snapshot_records(
    registry: Registry, *, cutoff: float, dry_run: bool
) -> list[tuple[str, float]]:
    """Remove the records whose prefix object is gone and whose mtime is before `cutoff`.

    Returns (relative path, mtime) of each record removed (or, dry, that would be). The
    caller holds the registry lock (gc); a record that parses or not is judged by its name.
    """
    removed = []
    for name, sha in _record_entries(registry):
        if not _head_missing(registry, sha):
            continue
        rel = f"{SNAPSHOTS}/{name}"
        st = registry.lstat(rel)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_mtime > cutoff:
            continue
        if not dry_run:
            try:
                registry.path(rel).unlink()
            except FileNotFoundError:
                continue
        removed.append((rel, st.st_mtime))
    if removed and not dry_run:
        fsutil.fsync_dir(registry.path(SNAPSHOTS))
    return removed


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

"""KV snapshot records on disk (`snapshots/<sha256>-<build>.json`), and hashing a snapshot file.

Invariants:
- The record path comes from `layout.snapshot_filename` only; a record whose content names
  another prefix or build than its file name is refused (`CorruptRecordError`), so a record
  cannot be moved to stand for another prefix. Records are read with the depth-capped JSON
  reader, never through a symlink.
- Writes are durable (`fsutil.replace_atomic`): saving the same prefix on the same build
  again replaces its record whole. A mirror is never written.
- For `verify` and `gc`: a record keeps its head (a prefix object or a frame record) as a
  name does, read from the record *file names*, so even a record that no longer parses keeps
  it; a record is removed only by `prune_snapshot_records` (gc `--prune-snapshots`), only
  when its head is gone and the record is older than the cutoff. Snapshot files live in the
  server's directory, outside the registry, and are never touched here; they are hashed
  through a no-follow descriptor that must be a regular file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

from prefixreg.core.errors import CorruptRecordError, IntegrityError, UsageError
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.core.snapshots import SnapshotRecord, validate_file_name
from prefixreg.registry import fsutil, layout
from prefixreg.registry.store import Registry


def _registry(reg: object) -> Registry:
    if not isinstance(reg, Registry):
        raise UsageError(f"not a Registry: {type(reg).__name__}")
    return reg


def write_snapshot(registry: Registry, record: SnapshotRecord) -> Path:
    """Write (or replace) the record of `record.sha256` on its build; its path. Raises:
    UsageError (not a `SnapshotRecord`, or a mirror), IntegrityError (a symlinked directory)."""
    registry = _registry(registry)
    if not isinstance(record, SnapshotRecord):
        raise UsageError(f"not a SnapshotRecord: {type(record).__name__}")
    registry.init()
    registry.refuse_on_mirror("write a snapshot record")
    directory = registry._disk.mkdir(layout.SNAPSHOTS)
    path = directory / layout.snapshot_filename(record.sha256, record.build_id)
    fsutil.replace_atomic(path, dumps_canonical(record.to_dict()) + b"\n", mode=0o644)
    return path


def _load(registry: Registry, name: str) -> SnapshotRecord:
    rel = f"{layout.SNAPSHOTS}/{name}"
    record = registry._disk.record(rel, SnapshotRecord.from_dict)
    if name != layout.snapshot_filename(record.sha256, record.build_id):
        path = registry._disk.path(rel)
        why = f"{path}: records prefix {record.sha256[:12]} on build {record.build_id}"
        raise CorruptRecordError(why, path=path)
    return record


def read_snapshot(registry: Registry, sha256: str, build_id: str) -> SnapshotRecord | None:
    """The record of `sha256` on `build_id`, or None. Raises: CorruptRecordError (it does not
    parse, or names another prefix or build), IntegrityError (a symlink)."""
    try:
        return _load(_registry(registry), layout.snapshot_filename(sha256, build_id))
    except FileNotFoundError:
        return None


def record_entries(registry: Registry) -> list[tuple[str, str]]:
    """(file name, head sha) of every entry of `snapshots/` named like a record."""
    entries = _registry(registry)._disk.entries(layout.SNAPSHOTS)
    matches = ((n, layout.SNAPSHOT_RECORD.fullmatch(n)) for n, kind in entries if kind == "file")
    return [(name, match.group(1)) for name, match in matches if match is not None]


def list_snapshots(registry: Registry, sha256: str | None = None) -> list[SnapshotRecord]:
    """Every snapshot record (of one head, or all), oldest first. Fails closed: an entry of
    `snapshots/` that is not a record (a junk name, a FIFO, a symlink, a directory; of this
    head, or any with `sha256` None) is never skipped in silence. Raises:
    CorruptRecordError (a record that does not parse, or such an entry), IntegrityError."""
    registry = _registry(registry)
    if sha256 is not None:
        layout.need_sha(sha256)
    names = []
    for name, kind in registry._disk.entries(layout.SNAPSHOTS):
        match = layout.SNAPSHOT_RECORD.fullmatch(name)
        if (sha256 is not None and not name.startswith(sha256)) or layout.is_temp_name(name):
            continue  # another head's, or a durable write in progress
        if kind != "file" or match is None:
            path = registry._disk.path(f"{layout.SNAPSHOTS}/{name}")
            what = {"link": "a symlink", "dir": "a directory", "other": "not a regular file"}
            why = what.get(kind, "not named <sha256>-<build id>.json")
            why = f"{path}: not a snapshot record ({why}); move it out of snapshots/"
            raise CorruptRecordError(why, path=path)
        names.append(name)
    out = [_load(registry, n) for n in names]
    return sorted(out, key=lambda r: (r.created, r.sha256, r.build_id))


def _head_missing(registry: Registry, sha: str) -> bool:
    """Neither a prefix object nor a frame record has this sha."""
    rels = (layout.object_relpath(sha), layout.frame_relpath(sha))
    return all(registry._disk.lstat(rel) is None for rel in rels)


def check_snapshot_entry(registry: Registry, name: str, kind: str) -> list[tuple[str, str]]:
    """`verify`'s (kind, message) findings for the entry `name` of `snapshots/`."""
    if kind != "file" or layout.SNAPSHOT_RECORD.fullmatch(name) is None:
        return [("unexpected", "not a snapshot record (<sha256>-<build id>.json)")]
    try:
        record = _load(registry, name)
    except (OSError, IntegrityError) as exc:
        return [("bad_record", str(exc))]
    try:
        missing = _head_missing(registry, record.sha256)
    except IntegrityError:
        return []  # behind a symlinked objects/ or frames/: the walk reports it
    return [("dangling", f"snapshot record of missing head {record.sha256}")] if missing else []


def prune_snapshot_records(
    registry: Registry, *, cutoff: float, dry_run: bool
) -> list[tuple[str, float]]:
    """Remove the records, parsed or not, whose head is gone and whose mtime is before
    `cutoff` (the caller holds the registry lock); (relative path, mtime) of each."""
    disk = registry._disk
    removed = []
    for name, sha in record_entries(registry):
        if _head_missing(registry, sha):
            rel = f"{layout.SNAPSHOTS}/{name}"
            if (mtime := disk.remove_old(rel, cutoff, dry_run=dry_run)) is not None:
                removed.append((rel, mtime))
    if removed and not dry_run:
        fsutil.fsync_dir(disk.path(layout.SNAPSHOTS))
    return removed


class FileDigests(NamedTuple):
    """Digests of one snapshot file (sha256 None: not computed) and its size in bytes."""

    sha256: str | None
    blake3: str
    size: int


def digest_snapshot_file(directory: Path | str, name: str, *, sha256: bool = True) -> FileDigests:
    """Hash the snapshot file `name` in the server's `directory` (blake3, and sha256 if
    asked) in one no-follow pass. Raises: FileNotFoundError; IntegrityError (a symlink or
    not a regular file); UsageError (not a snapshot file name)."""
    import blake3  # native, imported only where a snapshot file is hashed

    path = Path(directory) / validate_file_name(name)
    b3, sha = blake3.blake3(), hashlib.sha256() if sha256 else None
    size = 0
    for chunk in fsutil.read_chunks(path):
        size += len(chunk)
        b3.update(chunk)
        if sha is not None:
            sha.update(chunk)
    return FileDigests(None if sha is None else sha.hexdigest(), str(b3.hexdigest()), size)

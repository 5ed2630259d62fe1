"""Objects and their meta records: publish, verify at use, list (no-follow).

Invariants:
- Every read of an object re-hashes the bytes it returns; a mismatch raises
  `IntegrityError` and nothing is returned. There is no flag that skips this. The bytes
  hashed are the bytes returned (read once).
- Objects are published with no-overwrite links and never rewritten; publishing existing
  content re-verifies the object and refreshes its mtime (so age-based gc sees it used).
- Listing never follows a symlink: a symlinked `objects/` or fan-out directory, or an
  object entry that is not a regular file, raises `IntegrityError` (a read exits 3);
  entries that are not objects at all are left to `verify` to report.
- A meta record is written after its object, and only through `fsutil`'s durable writers.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError, IntegrityError, RefNotFoundError, UsageError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.clock import iso_utc, utc_now
from prefixreg.registry.disk import RegistryDisk

if TYPE_CHECKING:
    from prefixreg.core.records import Meta

__all__ = ["ObjectStore"]


class ObjectStore(RegistryDisk):
    """The objects and meta records of a registry (see the module invariants)."""

    def object_path(self, sha: str) -> Path:
        """Where the object with this (validated) sha lives."""
        return self.path(layout.object_relpath(sha))

    def meta_path(self, sha: str) -> Path:
        """Where the meta record of this (validated) sha lives."""
        return self.path(layout.meta_relpath(sha))

    # -- reads ----------------------------------------------------------------------------

    def _read_verified(self, sha: str) -> bytes:
        """The object's bytes, re-hashed and compared; `sha` must be validated already."""
        # The hot path of every get: one string path, no re-validation, no Path arithmetic.
        rel = layout.object_relpath_valid(sha)
        try:
            data = fsutil.read_nofollow(f"{self._root_s}/{rel}", root=self._root_s)
        except FileNotFoundError:
            raise RefNotFoundError(f"no prefix {sha}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            path = self.root / rel
            raise IntegrityError(
                f"{path}: content hashes to {actual}, expected {sha}; refusing to use it",
                path=path,
                expected=sha,
                actual=actual,
            )
        return data

    def read_verified(self, sha: str) -> bytes:
        """The bytes of object `sha` (a full sha), re-hashed and compared.

        Raises:
            UsageError: not a full sha. RefNotFoundError: no such object.
            IntegrityError: the stored bytes do not hash to their sha (or are not a regular
                file reached without a symlink).
        """
        given: object = sha  # the API boundary: callers may pass anything
        if not isinstance(given, str) or not is_full_sha(given):
            raise UsageError(f"not a sha256: {sha!r}")
        return self._read_verified(sha)

    def meta(self, sha: str) -> Meta:
        """The meta record of `sha` (parsed strictly).

        Raises:
            RefNotFoundError: no meta record. CorruptRecordError: unreadable or wrong.
        """
        rel = layout.meta_relpath(sha)
        path = self.root / rel
        try:
            raw = self.read_file(rel)
        except FileNotFoundError:
            raise RefNotFoundError(f"no meta record for {sha}") from None
        from prefixreg.core.records import Meta

        try:
            meta = Meta.from_dict(loads_object(raw, path=path))
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{path}: {exc}", path=path) from None
        if meta.sha256 != sha:
            raise CorruptRecordError(f"{path}: records sha {meta.sha256}", path=path)
        return meta

    def iter_shas(self, *, regular_only: bool = False) -> Iterator[str]:
        """Every object sha present (by file name; not verified), sorted.

        Args:
            regular_only: raise on an object entry that is not a regular file (a symlink,
                a directory, a FIFO) instead of yielding its sha for a verified read to
                refuse later.

        Raises:
            IntegrityError: `objects/` or a fan-out directory is a symlink (never listed
                through), or (`regular_only`) an object entry is not a regular file.
        """
        for fan, kind in self.entries(layout.OBJECTS):
            if kind == "link":
                raise IntegrityError(f"{self.root / layout.OBJECTS / fan}: is a symlink; refused")
            if kind != "dir" or layout.is_temp_name(fan):
                continue
            for entry, entry_kind in self.entries(f"{layout.OBJECTS}/{fan}"):
                sha = layout.object_sha(f"{layout.OBJECTS}/{fan}/{entry}")
                if sha is None:
                    continue
                if regular_only and entry_kind != "file":
                    where = self.root / layout.object_relpath(sha)
                    raise IntegrityError(f"{where}: not a regular file; refused", path=where)
                yield sha

    def _abbrev_matches(self, abbrev: str) -> list[str]:
        """Every object sha starting with `abbrev` (2+ lowercase hex digits)."""
        fan = f"{layout.OBJECTS}/{abbrev[:2]}"
        out = []
        for entry, kind in self.entries(fan):
            sha = layout.object_sha(f"{fan}/{entry}")
            if sha is not None and sha.startswith(abbrev):
                if kind != "file":
                    where = self.root / fan / entry
                    raise IntegrityError(f"{where}: not a regular file; refused", path=where)
                out.append(sha)
        return out

    # -- writes ---------------------------------------------------------------------------

    def _put_object(self, sha: str, data: bytes) -> None:
        """Publish `data` as object `sha` (hashed by the caller), or re-verify and refresh
        the object already there."""
        rel = layout.object_relpath(sha)
        path = self.root / rel
        self.writable_dir(rel.rsplit("/", 1)[0])
        # Look before writing: re-adding known content (the common case in a loop) then
        # costs a read and a hash, not a durable write; publish_new still settles races.
        for attempt in range(3):
            # The directory was just checked (no symlink on the way): a plain lexists.
            if not os.path.lexists(path) and fsutil.publish_new(path, data, mode=0o444):
                return
            # Existing object: re-verify (never trust what is already there), then
            # refresh its mtime so age-based gc sees it as recently used.
            try:
                self._read_verified(sha)
                os.utime(path, follow_symlinks=False)
                return
            except (RefNotFoundError, FileNotFoundError):
                # A concurrent `gc --prune-unnamed` removed it between our look and the
                # refresh: publish it again rather than fail or return a missing sha.
                if attempt == 2:
                    raise

    def _write_meta(self, sha: str, size: int, *, note: str | None, source: str) -> None:
        rel = layout.meta_relpath(sha)
        self.writable_dir(layout.META)
        path = self.root / rel
        if note is None and os.path.lexists(path):  # meta/ was just checked
            return
        # The on-disk form of `records.Meta`, built directly: the record classes are only
        # needed to read (and strictly validate) what is already there.
        record = {"sha256": sha, "bytes": size, "created": iso_utc(utc_now())}
        record |= {"source": source, "note": note}
        if fsutil.publish_new(path, dumps_canonical(record) + b"\n", mode=0o444) or note is None:
            return
        old = self.meta(sha)
        if old.note != note:
            updated = old.to_dict() | {"note": note}
            fsutil.replace_atomic(path, dumps_canonical(updated) + b"\n", mode=0o444)

"""`Disk`: a registry root, its marker and lock, and no-follow access below it by layout path.
Package-private: the registry's parts and use cases reach files only through it.

Invariants:
- Reads and listings follow no symlink below the root (`fsutil.open_below`); writes check or
  create their directories with `fsutil.ensure_dir`, which refuses a symlink on the way. The
  root itself may be a symlink (a user's choice).
- A directory is only written into if it is empty or carries `REGISTRY.json`, which is
  published first, so a concurrent opener never sees files without it.
- The lock file is a regular file in a real `.locks/` directory: a symlink in either place
  is refused before anything is created.
- A record that does not parse is `LegacyRecordError` (history of an adopted registry, in
  its own shape) only while `legacy.json` lists its path with the sha256 of its bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable, Generator, Iterable, Iterator
from os import stat_result
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from prefixreg.core import errors
from prefixreg.core.jsonio import JSONObject, loads_object
from prefixreg.registry import fsutil, layout

if TYPE_CHECKING:
    from prefixreg.registry import dirfd

T = TypeVar("T")
Legacy = tuple[dict[str, str], frozenset[str]]  # see `layout.parse_legacy`


class LegacyRecordError(errors.CorruptRecordError):
    """A record in an adopted registry's own shape, listed byte for byte in `legacy.json`:
    history, read as legacy, never as a current record."""


_README = """\
# prefix registry

This directory is a prefixreg registry (format {version}): a content-addressed store of
LLM prompt prefixes. `objects/<aa>/<sha256>.txt` holds the exact bytes of each prefix and
`sha256sum` of each file prints its own name. Do not edit files here by hand: use
`prefixreg` (`prefixreg verify` checks everything).
"""


class Disk:
    """The root of a registry. Raises `RegistryLocationError`: a file, a dangling link, a
    non-empty directory without `REGISTRY.json`, or a registry of a newer format."""

    def __init__(self, root: Path, *, marked: bool = True) -> None:
        self.root = root
        self.root_s = str(root)  # plain strings on the hot read path
        self.marker: dict[str, object] | None = None
        self._legacy: Legacy | None = None
        if root.is_symlink() and not root.exists():
            raise errors.RegistryLocationError(f"{root}: dangling symlink")
        if root.exists() and not root.is_dir():  # a symlinked root is followed once
            raise errors.RegistryLocationError(f"{root}: is a file, not a registry directory")
        if root.is_dir() and marked:  # `marked=False`: a hand-built tree, only walked
            self.load_marker()

    def load_marker(self) -> dict[str, object] | None:
        """The parsed marker (None: no registry here yet, and nothing else either)."""
        path = self.root / layout.MARKER
        if not path.is_symlink() and not path.exists():
            if any(not p.name.startswith(f".{layout.MARKER}.") for p in self.root.iterdir()):
                why = f"{self.root}: holds files but no {layout.MARKER}; refusing to use it"
                fix = "point --registry or PREFIXREG_HOME at an empty or new directory"
                raise errors.RegistryLocationError(why, hint=fix)
            return None
        data = loads_object(self.read(layout.MARKER), path=path)
        problem = layout.marker_problem(data)
        if problem is not None and problem[0] == "corrupt":
            raise errors.CorruptRecordError(f"{path}: {problem[1]}", path=path)
        if problem is not None:
            hint = "upgrade prefixreg" if problem[0] == "newer" else None
            raise errors.RegistryLocationError(f"{path}: {problem[1]}", hint=hint)
        self.marker = dict(data)
        return self.marker

    def create(self, role: str) -> None:
        """Make the registry (idempotent, safe to race): the marker first, then the rest."""
        if self.marker is not None or (self.root.is_dir() and self.load_marker() is not None):
            return
        self.root.mkdir(parents=True, exist_ok=True)
        marker = layout.encode_marker(role, layout.iso_utc(layout.utc_now()))
        fsutil.publish_new(self.root / layout.MARKER, marker, mode=0o644)
        self.load_marker()
        for sub in (layout.OBJECTS, layout.META, layout.NAMES, layout.MEASUREMENTS, layout.LOCKS):
            self.mkdir(sub)
        readme = _README.format(version=layout.FORMAT_VERSION).encode()
        fsutil.publish_new(self.root / layout.README, readme, mode=0o644)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def read(self, rel: str) -> bytes:
        """A regular file's bytes. Raises: FileNotFoundError; IntegrityError."""
        return fsutil.read_below(self.root_s, rel)

    def record(self, rel: str, parse: Callable[[JSONObject], T], raw: bytes | None = None) -> T:
        """The JSON record at `rel` (its bytes `raw`, else read), depth-capped, parsed by
        `parse`; errors name the path. Raises: FileNotFoundError; CorruptRecordError;
        IntegrityError."""
        path = self.root / rel
        raw = self.read(rel) if raw is None else raw
        try:
            return parse(loads_object(raw, path=path))
        except errors.CorruptRecordError as exc:
            if self.is_legacy(rel, raw):
                raise LegacyRecordError(f"{path}: a legacy record", path=path) from None
            raise errors.CorruptRecordError(f"{path}: {exc}", path=path) from None

    def is_legacy(self, rel: str, raw: bytes | None = None) -> bool:
        """Is `rel` a record `legacy.json` lists, its bytes (`raw`, else read) unchanged?"""
        if (want := self.legacy()[0].get(rel)) is None:
            return False
        try:
            return hashlib.sha256(self.read(rel) if raw is None else raw).hexdigest() == want
        except FileNotFoundError:
            return False

    def legacy(self) -> Legacy:
        """`legacy.json` parsed (empty without one). Raises: CorruptRecordError; IntegrityError."""
        if self._legacy is None:
            path = self.root / layout.LEGACY
            try:
                parsed = layout.parse_legacy(loads_object(self.read(layout.LEGACY), path=path))
            except FileNotFoundError:
                parsed = {}, frozenset()
            if parsed is None:
                raise errors.CorruptRecordError(f"{path}: not a legacy manifest", path=path)
            self._legacy = parsed
        return self._legacy

    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        """Sorted (name, kind) pairs of a directory ("" the root); see `fsutil.list_below`."""
        return fsutil.list_below(self.root_s, rel)

    def scan(self, rel: str, skip: Callable[[str, str], bool]) -> list[dirfd.Scanned]:
        """`entries` with each entry's lstat (None where `skip`); see `dirfd.scan_below`."""
        from prefixreg.registry import dirfd  # verify's and ls's: no start-up pays for it

        return dirfd.scan_below(self.root_s, rel, skip)

    def read_each(
        self, rel: str, names: Iterable[str]
    ) -> Generator[tuple[str, dirfd.ReadResult], None, None]:
        """Each file `names` of directory `rel`, no-follow; see `dirfd.read_each`."""
        from prefixreg.registry import dirfd

        return dirfd.read_each(self.root_s, rel, names)

    def walk(self, rel: str = "") -> Iterator[tuple[str, str]]:
        """Every entry below `rel` as (relative path, kind), parents first; a symlink is
        yielded, never descended into. Iterative: any depth is safe."""
        pending = [rel]
        while pending:
            current = pending.pop()
            for name, kind in self.entries(current):
                child = f"{current}/{name}" if current else name
                yield child, kind
                if kind == "dir":
                    pending.append(child)

    def refuse_links(self) -> None:
        """Raise `IntegrityError` naming the first symlink below the root (gc refuses it)."""
        for rel, kind in self.walk():
            if kind == "link":
                path = self.root / rel
                why = f"{path}: a symlink in the registry; refused"
                raise errors.IntegrityError(why, path=path)

    def lstat(self, rel: str) -> stat_result | None:
        """`lstat` of a path (None if missing); no directory above it may be a symlink."""
        path = self.root / rel
        fsutil.ensure_dir(self.root, path.parent, create=False)
        try:
            return os.lstat(f"{self.root_s}/{rel}")
        except FileNotFoundError:
            return None

    def remove_old(self, rel: str, cutoff: float, *, dry_run: bool) -> float | None:
        """Remove the regular file `rel` if its mtime is before `cutoff` (not when `dry_run`);
        its mtime, or None: gone, not a file, or young (may be a write in flight)."""
        st = self.lstat(rel)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_mtime > cutoff:
            return None
        if not dry_run:
            try:
                self.path(rel).unlink()
            except FileNotFoundError:
                return None
        return st.st_mtime

    def mkdir(self, rel: str) -> Path:
        """Create the directory `rel` if needed and return its path; never through a link."""
        fsutil.ensure_dir(self.root, self.root / rel)
        return self.root / rel

    def torn_tail(self, rel: str) -> int:
        """Bytes of the journal `rel` after its last newline: an interrupted write (0: none)."""
        try:
            raw = self.read(rel)
        except FileNotFoundError:
            return 0
        return len(raw) - raw.rfind(b"\n") - 1

    def cut_tail(self, rel: str) -> list[str]:
        """Cut a torn tail off the journal `rel` (the caller holds its lock); what was done."""
        torn = self.torn_tail(rel)
        if not torn:
            return []
        path = self.path(rel)
        fsutil.truncate(path, path.stat().st_size - torn, root=self.root)
        return [f"{rel}: cut off a torn last line ({torn} bytes)"]

    @contextlib.contextmanager
    def lock(self, name: str, timeout: float) -> Iterator[None]:
        """Hold the exclusive lock `.locks/<name>.lock`."""
        import filelock  # only writers need it

        path = self.mkdir(layout.LOCKS) / f"{name}.lock"
        st = self.lstat(f"{layout.LOCKS}/{name}.lock")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise errors.IntegrityError(f"{path}: not a regular lock file; refused", path=path)
        lock = filelock.FileLock(str(path))
        try:
            lock.acquire(timeout=timeout)
        except filelock.Timeout as exc:
            message = f"could not take the {name} lock within {timeout:g}s"
            raise errors.LockTimeoutError(message, path=path) from exc
        try:
            yield
        finally:
            lock.release()

"""The registry root and its primitives: location, marker, init, lock, no-follow access.

Every path below the root is built from a `layout` rule and reached through `fsutil`'s
no-follow primitives; this base class is the one place the store turns a relative layout
path into an absolute one.

Invariants:
- A directory is only written into if it is empty or carries `REGISTRY.json`.
- No symlink below the root is followed, by a read, a listing or a write: reads and
  listings open every component with `O_NOFOLLOW`, writes create their directories with
  `fsutil.ensure_dir` (which refuses a symlink on the way). The root itself may be a
  symlink (a user's choice, e.g. a moved home).
- The lock file lives in `.locks/`, which must be a real directory of the registry and the
  lock file a regular file: a symlink in either place is refused before anything is created.
- A mirror (role `mirror`) is written only by `prefixreg mirror`; write calls refuse it.
"""

from __future__ import annotations

import contextlib
import stat
from collections.abc import Iterator
from os import stat_result
from pathlib import Path
from typing import Literal

from prefixreg.core.errors import (
    CorruptRecordError,
    IntegrityError,
    LockTimeoutError,
    RegistryLocationError,
    UsageError,
)
from prefixreg.core.jsonio import loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.clock import iso_utc, utc_now

__all__ = ["RegistryDisk"]

_README = """\
# prefix registry

This directory is a prefixreg registry (format {version}): a content-addressed store of
LLM prompt prefixes. `objects/<aa>/<sha256>.txt` holds the exact bytes of each prefix and
`sha256sum` of each file prints its own name. Do not edit files here by hand: use
`prefixreg` (`prefixreg verify` checks everything).
"""


class RegistryDisk:
    """A registry root: where it is, what it is, and no-follow access to what is below it.

    Args:
        root: the registry directory.
        lock_timeout: seconds to wait for the registry lock before `LockTimeoutError`.

    Raises:
        RegistryLocationError: `root` is a file, a non-empty directory without
            `REGISTRY.json`, or a registry of a newer format.
    """

    def __init__(self, root: Path | str, *, lock_timeout: float = 30.0) -> None:
        self.root = Path(root)
        # Plain strings for the hot read path (no Path arithmetic per verified read).
        self._root_s = str(self.root)
        self.lock_timeout = lock_timeout
        self._marker: dict[str, object] | None = None
        self._check_location()

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    # -- no-follow access by layout path ----------------------------------------------------

    def path(self, rel: str) -> Path:
        """The absolute path of a layout path (`layout.object_relpath(...)` and friends)."""
        return self.root / rel

    def read_file(self, rel: str) -> bytes:
        """The bytes of a registry file, read without following any symlink below the root.

        Raises:
            FileNotFoundError: no such file. IntegrityError: a symlink, or not a regular file.
        """
        return fsutil.read_nofollow(f"{self._root_s}/{rel}", root=self._root_s)

    def entries(self, rel: str = "") -> list[tuple[str, str]]:
        """The entries of a registry directory as sorted (name, kind) pairs, kind one of
        `file`, `dir`, `link`, `other`; never following a symlink (a missing directory is
        empty). `rel` "" lists the root.

        Raises:
            IntegrityError: the directory (or one above it) is a symlink or not a directory.
        """
        if not rel:
            return fsutil.list_dir(self._root_s, root=self._root_s)
        return fsutil.list_dir(f"{self._root_s}/{rel}", root=self._root_s)

    def walk(self, rel: str = "") -> Iterator[tuple[str, str]]:
        """Every entry below the registry directory `rel` as (relative path, kind), parents
        before children; a symlink is yielded (kind `link`), never descended into.

        Raises:
            IntegrityError: `rel` itself (or a directory above it) is a symlink.
        """
        pending = [rel]
        while pending:
            current = pending.pop()
            for name, kind in self.entries(current):
                child = f"{current}/{name}" if current else name
                yield child, kind
                if kind == "dir":
                    pending.append(child)

    def refuse_links(self) -> None:
        """Raise `IntegrityError` naming the first symlink below the root, if there is one:
        the whole-tree verbs (gc, migrate) refuse to run on such a registry."""
        for rel, kind in self.walk():
            if kind == "link":
                path = self.root / rel
                raise IntegrityError(
                    f"{path}: a symlink in the registry; refused (verify reports it)", path=path
                )

    def lstat(self, rel: str) -> stat_result | None:
        """`lstat` of a registry path (None if missing), after checking no directory above
        it is a symlink."""
        path = self.root / rel
        fsutil.check_no_symlinks(self.root, path.parent)
        try:
            return path.lstat()
        except FileNotFoundError:
            return None

    def writable_dir(self, rel: str) -> Path:
        """Create the registry directory `rel` if needed and return its path; refuses to
        create or pass through a symlink."""
        path = self.root / rel
        fsutil.ensure_dir(self.root, path)
        return path

    # -- location and marker ------------------------------------------------------------------

    def _check_location(self) -> bool:
        """Refuse a root that is not (or cannot become) a registry; True if it is one."""
        root = self.root
        try:
            st = root.lstat()
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            # A symlinked root is a user's choice (e.g. a moved home); follow it once.
            try:
                st = root.stat()
            except FileNotFoundError:
                raise RegistryLocationError(f"{root}: dangling symlink") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RegistryLocationError(f"{root}: is a file, not a registry directory")
        marker = root / layout.MARKER
        if marker.is_symlink() or marker.exists():
            self._load_marker()
            return True
        others = [p.name for p in root.iterdir() if not p.name.startswith(f".{layout.MARKER}.")]
        if others:
            raise RegistryLocationError(
                f"{root}: holds files but no {layout.MARKER}; refusing to use it as a registry",
                hint="point --registry or PREFIXREG_HOME at an empty or new directory",
            )
        return False

    def _load_marker(self) -> dict[str, object]:
        path = self.root / layout.MARKER
        data = loads_object(self.read_file(layout.MARKER), path=path)
        problem = layout.marker_problem(data)
        if problem is not None:
            kind, message = problem
            if kind == "corrupt":
                raise CorruptRecordError(f"{path}: {message}", path=path)
            hint = "upgrade prefixreg" if kind == "newer" else None
            raise RegistryLocationError(f"{path}: {message}", hint=hint)
        self._marker = dict(data)
        return self._marker

    @property
    def exists(self) -> bool:
        """True once the registry has been initialised (its marker exists)."""
        return self._marker is not None or (self.root / layout.MARKER).exists()

    @property
    def role(self) -> str | None:
        """`origin` or `mirror`, or None before initialisation."""
        if self._marker is None and (self.root / layout.MARKER).exists():
            self._load_marker()
        return None if self._marker is None else str(self._marker["role"])

    def init(self, *, role: Literal["origin", "mirror"] = "origin") -> None:
        """Create the registry if it does not exist yet (idempotent, safe to race)."""
        if self._marker is not None or self._check_location():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        marker = layout.encode_marker(role, iso_utc(utc_now()))
        # The marker goes first, so a concurrent opener never sees files without it.
        fsutil.publish_new(self.root / layout.MARKER, marker, mode=0o644)
        self._load_marker()
        for sub in (layout.OBJECTS, layout.META, layout.NAMES, layout.MEASUREMENTS, layout.LOCKS):
            self.writable_dir(sub)
        readme = _README.format(version=layout.FORMAT_VERSION).encode()
        fsutil.publish_new(self.root / layout.README, readme, mode=0o644)

    def refuse_on_mirror(self, what: str) -> None:
        """Refuse a write API call on a mirror: the next mirror run would delete it."""
        if self.role == "mirror":
            raise UsageError(
                f"{self.root} is a mirror; refusing to {what} here (the next mirror run "
                "would delete it)",
                hint="write on the origin registry (the coordinator), then run prefixreg mirror",
            )

    @contextlib.contextmanager
    def lock(self, name: str = "registry") -> Iterator[None]:
        """Hold the registry's exclusive lock (`.locks/<name>.lock`)."""
        import filelock  # only writers need it

        self.init()
        path = self.writable_dir(layout.LOCKS) / f"{name}.lock"
        st = self.lstat(f"{layout.LOCKS}/{name}.lock")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{path}: not a regular lock file; refused", path=path)
        lock = filelock.FileLock(str(path))
        try:
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise LockTimeoutError(
                f"could not take the {name} lock within {self.lock_timeout:g}s", path=path
            ) from exc
        try:
            yield
        finally:
            lock.release()

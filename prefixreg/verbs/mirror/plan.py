"""A mirror plan judged at the source: may each entry travel, and what does it point to.

Role: judge the entries of an rsync plan (`Change`s) by the rules of `registry.layout`,
re-hash the source objects about to travel (`SourceVerifier`), and find the objects the
name, meta and frame records about to travel point to. Records are read through the
store's public API only (a frame through `Registry.head`: record and parts verified, its
JSON read by the one depth-capped reader).

Invariants:
- A plan entry that would travel is one of: a directory at a directory's place (`objects`,
  a fan `objects/<aa>`, `meta`, `names`, ...), a regular file named by `layout` at an
  object's or record's place, or some other regular file or directory (measurements,
  probes, journals). Anything else (a symlink, device or FIFO anywhere; a directory where
  an object or record file belongs; a file where a directory belongs; a stray path under
  `objects/`) is an `IntegrityError` before anything is sent (exit 3).
- An object path is sent only after `SourceVerifier` returned it: a path that is not an
  object file, or bytes that do not hash to their name, raise `IntegrityError`. Objects
  are immutable, so a path verified once in a run is not hashed again; one verifier is
  shared by every destination of the run (thread-safe).
- `referenced_objects` returns only objects present and verified at the source now; a
  record whose object is missing while the record stays is an `IntegrityError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prefixreg.core.errors import (
    CorruptRecordError,
    IntegrityError,
    InvalidNameError,
    RefNotFoundError,
)
from prefixreg.core.frame import Frame
from prefixreg.registry.layout import (
    EXPECTED_DIRS,
    FRAMES,
    META,
    NAMES,
    OBJECTS,
    ROOT_FILES,
    frame_sha,
    is_temp_name,
    meta_sha,
    object_relpath,
    object_sha,
)
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.rsync import Change

Verify = Callable[[Iterable[str]], list[str]]


def top(path: str) -> str:
    """The root entry a plan path lies in (`objects` for `objects/ab/...`)."""
    return path.split("/", 1)[0]


def shape_problem(change: Change) -> str | None:
    """Why this entry may not travel, or None when its type fits its place in the layout."""
    kind = change.kind
    if kind not in ("file", "dir"):
        return f"a {kind}, not a regular file or directory"
    parts = change.path.split("/")
    if len(parts) == 1:
        if parts[0] in EXPECTED_DIRS and kind != "dir":
            return "a file where a registry directory belongs"
        if parts[0] in ROOT_FILES and kind != "file":
            return "a directory where a registry file belongs"
        return None
    if parts[0] == OBJECTS:
        if len(parts) == 2:
            return None if kind == "dir" else "a file where an object fan directory belongs"
        if len(parts) == 3 and object_sha(change.path) is not None:
            return None if kind == "file" else "a directory where an object file belongs"
        return "not an object file"
    if parts[0] in (META, NAMES, FRAMES):
        if len(parts) == 2:
            return None if kind == "file" else f"a directory where a {parts[0]} record belongs"
        return f"not a {parts[0]} record"
    return None


def check_shapes(root: Path, plan: Iterable[Change]) -> None:
    """Refuse a plan that would send anything but the layout's regular files and directories.

    Raises:
        IntegrityError: the first entry whose type does not fit its place (nothing sent).
    """
    for c in plan:
        problem = None if c.is_delete or c.path == "." else shape_problem(c)
        if problem is not None:
            raise IntegrityError(
                f"{root / c.path}: {problem}; refusing to mirror", path=root / c.path
            )


def objects_to_verify(changes: Iterable[Change]) -> list[str]:
    """Every object-path entry about to be sent that is not a directory (a symlink or FIFO
    in objects/ must reach the verifier, which refuses it, instead of travelling)."""
    return sorted({c.path for c in changes if c.is_object and not c.is_delete and not c.is_dir})


class SourceVerifier:
    """Re-hashes source objects (`Registry.read_verified`: no-follow, regular files only)
    before they travel. An object removed at the source since the plan (a concurrent gc) is
    left out: it is not sent, and the confirm pass sees the rest."""

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.count = 0
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, paths: Iterable[str]) -> list[str]:
        """The paths in `paths` that verified (vanished ones left out).

        Raises:
            IntegrityError: a path in objects/ that is not an object file (a symlink, a
                directory, a FIFO, a stray name), or an object whose bytes do not hash to
                its name.
        """
        ok = []
        for rel in paths:
            with self._lock:
                done = rel in self._done
            if not done:
                sha = object_sha(rel)
                if sha is None:
                    where = self.reg.root / rel
                    raise IntegrityError(
                        f"{where}: not an object file; refusing to mirror it", path=where
                    )
                try:
                    self.reg.read_verified(sha)
                except RefNotFoundError:
                    continue
                with self._lock:
                    self.count += rel not in self._done
                    self._done.add(rel)
            ok.append(rel)
        return ok


def _points_to(reg: Registry, path: str, *, recheck: bool = False) -> str | None:
    """The sha the name or meta record at `path` points to now; None when it is gone.

    A meta record is named by its sha: only with `recheck` is it looked at again.
    """
    kind, _, entry = path.partition("/")
    if kind == FRAMES:
        return frame_sha(path)
    if kind == META:
        sha = meta_sha(path)
        try:
            if recheck and sha is not None:
                reg.meta(sha)
        except RefNotFoundError:
            return None
        except CorruptRecordError:
            pass  # there, if unreadable: it still points to its object
        return sha
    try:
        return reg.read_name(entry)
    except InvalidNameError:
        where = reg.root / path
        raise IntegrityError(f"{where}: not a valid name; refusing", path=where) from None


def referenced_objects(
    reg: Registry, changes: Sequence[Change], verify: Verify, frames: set[str] | None = None
) -> set[str]:
    """Objects the meta, frame and name records in `changes` point to, read at the source now.

    A frame record, or a name that points to a frame, stands for the frame's parts (system
    and tools objects; read through `Registry.head`, so verified); a named frame's sha is
    added to `frames`, so its record travels before the name.

    Each object is verified (`verify`) before it counts. A record removed at the source
    since the plan is skipped (it will not be sent), and so is one whose object and record
    were both pruned meanwhile (gc removes the record first, so a record without its object
    is only ever seen mid-removal) or a name that moved meanwhile.

    Raises:
        IntegrityError: a name or meta path that is not a regular file, a name that does
            not parse, a frame or referenced object that fails verification, or a record
            whose object is missing at the source while the record stays.
    """
    shas: set[str] = set()
    for c in changes:
        kind, _, entry = c.path.partition("/")
        if c.is_delete or c.is_dir or kind not in (META, NAMES, FRAMES) or "/" in entry:
            continue
        if kind == NAMES and is_temp_name(entry):
            continue
        where = reg.root / c.path
        if not c.is_file:
            raise IntegrityError(f"{where}: not a regular file; refusing to mirror it", path=where)
        sha = _points_to(reg, c.path)
        if sha is None:
            continue  # removed since the plan: it will not be sent
        try:
            head = reg.head(sha) if kind != META else None
        except RefNotFoundError:
            head = None  # neither object nor frame: judged below, like a missing object
        if isinstance(head, Frame):
            if frames is not None and kind == NAMES:
                frames.add(sha)
            parts = [p for p in (head.system.sha256, head.tools_sha256) if p is not None]
            shas.update(p for p in parts if verify([object_relpath(p)]))
        elif kind == FRAMES:
            continue  # the frame record left the source since the plan: it is not sent
        elif verify([object_relpath(sha)]):
            shas.add(sha)
        elif _points_to(reg, c.path, recheck=True) == sha and not verify([object_relpath(sha)]):
            # Still there and still pointing to it: the source itself is broken.
            raise IntegrityError(
                f"{where} points to {sha}, which is not in the registry; refusing", path=where
            )
    return shas

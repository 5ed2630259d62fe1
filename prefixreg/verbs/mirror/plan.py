"""A mirror plan judged at the source: may each entry travel, and what does it point to.

Role: judge the entries of an rsync plan (`Change`s) by the rules of `registry.layout`,
re-hash the source objects about to travel (`SourceVerifier`), and find the objects the
name, meta and frame records about to travel point to, through the store's public API (a
frame through `Registry.head`: record and parts verified, its JSON read depth-capped).

Invariants:
- A plan entry that travels is a directory at a directory's place (`objects`, a fan
  `objects/<aa>`, `meta`, ...), a regular file at an object's or record's place, or some
  other regular file or directory (measurements, probes, journals). Anything else (a
  symlink, device or FIFO anywhere; a directory where an object or record file belongs; a
  file where a directory belongs; a stray path under `objects/`) is an `IntegrityError`
  before anything is sent (exit 3).
- An object path is sent only after `SourceVerifier` returned it. Objects are immutable,
  so one verifier, shared by every destination of a run, hashes each path once.
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
from prefixreg.registry import layout
from prefixreg.registry.layout import FRAMES, META, NAMES, OBJECTS, object_relpath
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.rsync import Change

Verify = Callable[[Iterable[str]], list[str]]


def top(path: str) -> str:
    """The root entry a plan path lies in (`objects` for `objects/ab/...`)."""
    return path.split("/", 1)[0]


def shape_problem(change: Change) -> str | None:
    """Why this entry may not travel, or None when its type fits its place in the layout."""
    kind, parts = change.kind, change.path.split("/")
    if kind not in ("file", "dir"):
        return f"a {kind}, not a regular file or directory"
    if len(parts) == 1:
        if parts[0] in layout.EXPECTED_DIRS and kind != "dir":
            return "a file where a registry directory belongs"
        if parts[0] in layout.ROOT_FILES and kind != "file":
            return "a directory where a registry file belongs"
        return None
    if parts[0] == OBJECTS:
        if len(parts) == 2:
            return None if kind == "dir" else "a file where an object fan directory belongs"
        if layout.object_sha(change.path) is None:
            return "not an object file"
        return None if kind == "file" else "a directory where an object file belongs"
    if parts[0] in (META, NAMES, FRAMES):
        if len(parts) > 2:
            return f"not a {parts[0]} record"
        return None if kind == "file" else f"a directory where a {parts[0]} record belongs"
    return None


def check_shapes(root: Path, plan: Iterable[Change]) -> None:
    """Refuse a plan that would send anything but the layout's regular files and directories.

    Raises:
        IntegrityError: the first entry whose type does not fit its place (nothing sent).
    """
    for c in plan:
        problem = None if c.is_delete or c.path == "." else shape_problem(c)
        if problem is not None:
            where = root / c.path
            raise IntegrityError(f"{where}: {problem}; refusing to mirror", path=where)


def objects_to_verify(changes: Iterable[Change]) -> list[str]:
    """Every object-path entry about to be sent that is not a directory (a symlink or FIFO
    in objects/ must reach the verifier, which refuses it, instead of travelling)."""
    return sorted({c.path for c in changes if c.is_object and not c.is_delete and not c.is_dir})


class SourceVerifier:
    """Re-hashes source objects (`Registry.read_verified`: no-follow, regular files only)
    before they travel; thread-safe. `count` is how many it hashed."""

    def __init__(self, reg: Registry) -> None:
        self.reg, self.count = reg, 0
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, paths: Iterable[str]) -> list[str]:
        """The paths in `paths` that verified. An object removed at the source since the
        plan (a concurrent gc) is left out: it is not sent; the confirm pass sees the rest.

        Raises:
            IntegrityError: a path in objects/ that is not an object file (a symlink, a
                directory, a FIFO, a stray name), or bytes that do not hash to its name.
        """
        ok = []
        for rel in paths:
            sha = layout.object_sha(rel)
            if sha is None:
                where = self.reg.root / rel
                raise IntegrityError(
                    f"{where}: not an object file; refusing to mirror it", path=where
                )
            with self._lock:
                done = rel in self._done
            if not done:
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
    """The sha the record at `path` points to now; None when it is gone. A meta or frame
    record is named by its sha: only with `recheck` is a meta record looked at again."""
    kind, _, entry = path.partition("/")
    if kind == FRAMES:
        return layout.frame_sha(path)
    if kind == NAMES:
        try:
            return reg.read_name(entry)
        except InvalidNameError:
            raise IntegrityError(
                f"{reg.root / path}: not a valid name; refusing", path=reg.root / path
            ) from None
    sha = layout.meta_sha(path)
    try:
        if recheck and sha is not None:
            reg.meta(sha)
    except RefNotFoundError:
        return None
    except CorruptRecordError:
        pass  # there, if unreadable: it still points to its object
    return sha


def referenced_objects(
    reg: Registry, changes: Sequence[Change], verify: Verify
) -> dict[str, set[str]]:
    """What each meta, frame and name record in `changes` needs at the destination first,
    read at the source now: {record path: the object paths (and, for a name of a frame, the
    frame record's path) it points to}.

    A frame stands for its parts (system and tools objects). Each object is verified
    (`verify`) before it counts. A record removed at the source since the plan is left out
    (it will not be sent), and so is one whose object and record were both pruned meanwhile
    (gc removes the record first, so a record without its object is only ever seen
    mid-removal) or a name that moved meanwhile.

    Raises:
        IntegrityError: a record path that is not a regular file, a name that does not
            parse, a frame or object that fails verification, or a record whose object is
            missing at the source while the record stays.
    """
    needs: dict[str, set[str]] = {}
    for c in changes:
        kind, _, entry = c.path.partition("/")
        if c.is_delete or c.is_dir or kind not in (META, NAMES, FRAMES) or "/" in entry:
            continue
        if kind == NAMES and layout.is_temp_name(entry):
            continue
        where = reg.root / c.path
        if not c.is_file:
            raise IntegrityError(f"{where}: not a regular file; refusing to mirror it", path=where)
        if (sha := _points_to(reg, c.path)) is None:
            continue  # removed since the plan: it will not be sent
        try:
            head = None if kind == META else reg.head(sha)
        except RefNotFoundError:
            head = None  # neither object nor frame: judged below, like a missing object
        if isinstance(head, Frame):
            parts = [p for p in (head.system.sha256, head.tools_sha256) if p is not None]
            needs[c.path] = set(verify(object_relpath(p) for p in parts))
            if kind == NAMES:
                needs[c.path].add(layout.frame_relpath(sha))
        elif kind == FRAMES:
            continue  # the frame record left the source since the plan: it is not sent
        elif verify([object_relpath(sha)]):
            needs[c.path] = {object_relpath(sha)}
        elif _points_to(reg, c.path, recheck=True) == sha and not verify([object_relpath(sha)]):
            # Still there and still pointing to it: the source itself is broken.
            raise IntegrityError(
                f"{where} points to {sha}, which is not in the registry; refusing", path=where
            )
    return needs

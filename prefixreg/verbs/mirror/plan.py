"""A mirror plan read by the registry's layout: what each itemized entry is, and may it travel.

Role: judge the entries of an rsync plan (`Change`s) by the rules of `registry.layout`, and
find the objects that the name and meta records about to travel point to. Every path rule
and parse comes from `layout`; records are read through the store's public API only.

Invariants:
- A plan entry that would travel is one of: a directory at a directory's place (`objects`,
  a fan `objects/<aa>`, `meta`, `names`, ...), a regular file named by `layout` at an
  object's or record's place, or some other regular file or directory (measurements,
  probes, journals). Anything else (a symlink, device or FIFO anywhere; a directory where
  an object or record file belongs; a file where a directory belongs; a stray path under
  `objects/`) is an `IntegrityError` before anything is sent (exit 3).
- `referenced_objects` returns only objects present and verified at the source now; a
  record whose object is missing while the record stays is an `IntegrityError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prefixreg.core.errors import (
    CorruptRecordError,
    IntegrityError,
    InvalidNameError,
    RefNotFoundError,
)
from prefixreg.registry.frames import is_frame, read_frame
from prefixreg.registry.layout import (
    EXPECTED_DIRS,
    FRAMES,
    META,
    NAMES,
    OBJECTS,
    ROOT_FILES,
    is_temp_name,
    meta_sha,
    object_relpath,
    object_sha,
)
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.rsync import Change

__all__ = [
    "check_shapes",
    "objects_to_verify",
    "referenced_objects",
    "top",
]

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
        if c.is_delete or c.path == ".":
            continue
        problem = shape_problem(c)
        if problem is not None:
            path = root / c.path
            raise IntegrityError(f"{path}: {problem}; refusing to mirror", path=path)


def objects_to_verify(changes: Iterable[Change]) -> list[str]:
    """Every object-path entry about to be sent that is not a directory.

    Not only regular files: anything else in objects/ (a symlink, a FIFO) must reach the
    verifier, which refuses it, instead of travelling unchecked.
    """
    return sorted({c.path for c in changes if c.is_object and not c.is_delete and not c.is_dir})


def _record_sha(reg: Registry, path: str) -> tuple[bool, str | None]:
    """(is a record, the sha it points to now); (True, None) when it is gone since the plan."""
    parts = path.split("/")
    if len(parts) != 2:
        return False, None
    if parts[0] == META:
        sha = meta_sha(path)
        return sha is not None, sha
    if parts[0] != NAMES or is_temp_name(parts[1]):
        return False, None
    try:
        return True, reg.read_name(parts[1])
    except InvalidNameError:
        where = reg.root / path
        raise IntegrityError(f"{where}: not a valid name; refusing", path=where) from None


def _still_there(reg: Registry, path: str, sha: str) -> bool:
    """True when the record at `path` still exists (and, for a name, still says `sha`)."""
    if top(path) == META:
        try:
            reg.meta(sha)
        except RefNotFoundError:
            return False
        except CorruptRecordError:
            return True  # there, if unreadable: it still points nowhere
        return True
    return _record_sha(reg, path)[1] == sha


def frame_parts_of(reg: Registry, sha: str) -> tuple[str, ...] | None:
    """The objects frame `sha` names (its record and parts verified), or None when `sha` is
    not a frame.

    Raises:
        IntegrityError: the frame record or one of its parts fails verification.
    """
    if not is_frame(reg, sha):
        return None
    frame = read_frame(reg, sha)
    return tuple(s for s in (frame.system.sha256, frame.tools_sha256) if s is not None)


def referenced_objects(
    reg: Registry,
    changes: Sequence[Change],
    verify: Verify,
    frames: set[str] | None = None,
) -> set[str]:
    """Objects the meta records and names in `changes` point to, read from the source now.

    A name that points to a frame stands for the frame's parts (system and tools objects);
    the frame's sha is added to `frames`, so its record travels before the name.

    Each is verified (`verify`) before it counts. A record removed at the source since the
    plan is skipped (it will not be sent), and so is a meta record whose object and record
    were both pruned meanwhile (gc removes the record first, so a record without its object
    is only ever seen mid-removal).

    Raises:
        IntegrityError: a name or meta path that is not a regular file, a name that does
            not parse, a referenced object that fails verification, or a name or meta
            record whose object is missing at the source (it could never arrive).
    """
    shas: set[str] = set()
    for c in changes:
        if c.is_delete or c.is_dir:
            continue
        is_record, sha = _record_sha(reg, c.path)
        if not is_record:
            continue
        where = reg.root / c.path
        if not c.is_file:
            raise IntegrityError(f"{where}: not a regular file; refusing to mirror it", path=where)
        if sha is None:
            continue  # removed since the plan: it will not be sent
        parts = frame_parts_of(reg, sha) if top(c.path) == NAMES else None
        if parts is not None:
            if frames is not None:
                frames.add(sha)
            shas.update(p for p in parts if verify([object_relpath(p)]))
            continue
        rel = object_relpath(sha)
        # Object missing: look at the record again. Gone (gc pruned both) or changed (a
        # name moved): it is not what will be sent, so it needs nothing. Still there and
        # the object still missing: the source itself is broken.
        if verify([rel]):
            shas.add(sha)
        elif _still_there(reg, c.path, sha):
            if verify([rel]):
                shas.add(sha)
            else:
                raise IntegrityError(
                    f"{where} points to {sha}, which is not in the registry; refusing",
                    path=where,
                )
    return shas

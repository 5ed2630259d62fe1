"""A mirror plan judged at the source, by `registry.layout`'s rules and the store's API.

Invariants:
- A plan entry that travels is a directory at a directory's place, a regular file at an
  object's or record's place, or another regular file or directory (measurements, probes,
  journals). Anything else (a symlink, device or FIFO; a directory where a file belongs or
  the reverse; a stray path under `objects/`) is an `IntegrityError` before anything is
  sent (exit 3).
- An object path is sent only after `SourceVerifier` re-hashed it (once per run: objects
  are immutable). A record travels only after what it points to, read through the store
  (a frame through `Registry.head`: record and parts verified, its JSON depth-capped); a
  record whose object is missing while the record stays is an `IntegrityError`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from prefixreg.core import errors
from prefixreg.core.errors import IntegrityError, RefNotFoundError
from prefixreg.core.frame import Frame
from prefixreg.registry import layout
from prefixreg.registry.layout import FRAMES, META, NAMES, OBJECTS, object_relpath
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.rsync import Change

Verify = Callable[[Iterable[str]], list[str]]


def _refused(where: Path, why: str) -> IntegrityError:
    return IntegrityError(f"{where}: {why}; refusing to mirror it", path=where)


def top(path: str) -> str:
    """The root entry a plan path lies in (`objects` for `objects/ab/...`)."""
    return path.split("/", 1)[0]


def shape_problem(change: Change) -> str | None:
    """Why this entry may not travel, or None when its type fits its place in the layout."""
    kind, tree, depth = change.kind, top(change.path), change.path.count("/") + 1
    if kind not in ("file", "dir"):
        return f"a {kind}, not a regular file or directory"
    if tree == OBJECTS and depth > 2 and layout.object_sha(change.path) is None:
        return "not an object file"
    if tree in (META, NAMES, FRAMES) and depth > 2:
        return f"not a {tree} record"
    if depth == 1 and tree in layout.EXPECTED_DIRS:
        want, place = "dir", "a registry directory"
    elif depth == 1 and tree in layout.ROOT_FILES:
        want, place = "file", "a registry file"
    elif tree == OBJECTS and depth == 2:
        want, place = "dir", "an object fan directory"
    elif tree == OBJECTS and depth > 2:
        want, place = "file", "an object file"
    elif tree in (META, NAMES, FRAMES) and depth > 1:
        want, place = "file", f"a {tree} record"
    else:
        return None
    return None if kind == want else f"a {kind.replace('dir', 'directory')} where {place} belongs"


def check_shapes(root: Path, plan: Iterable[Change]) -> None:
    """Refuse a plan that would send anything but the layout's regular files and directories.

    Raises:
        IntegrityError: the first entry whose type does not fit its place (nothing sent).
    """
    for c in plan:
        problem = None if c.is_delete or c.path == "." else shape_problem(c)
        if problem is not None:
            raise _refused(root / c.path, problem)


def objects_to_verify(changes: Iterable[Change]) -> list[str]:
    """Every object-path entry about to be sent that is not a directory (a symlink or FIFO
    in objects/ must reach the verifier, which refuses it, instead of travelling)."""
    return sorted({c.path for c in changes if c.is_object and not c.is_delete and c.kind != "dir"})


class SourceVerifier:
    """Re-hashes source objects before they travel (`Registry.read_verified`: no-follow,
    regular files only); shared by a run's destinations. `done`: the paths it hashed."""

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.done: set[str] = set()  # set.add is atomic: destinations' threads share it

    def __call__(self, paths: Iterable[str]) -> list[str]:
        """The paths that verified, less those a gc removed since the plan (not sent).

        Raises:
            IntegrityError: a path not an object file, not a regular file, or a wrong hash.
        """
        ok = []
        for rel in paths:
            if (sha := layout.object_sha(rel)) is None:
                raise _refused(self.reg.root / rel, "not an object file")
            if rel not in self.done:
                try:
                    self.reg.read_verified(sha)
                except RefNotFoundError:
                    continue
                self.done.add(rel)
            ok.append(rel)
        return ok


def _points_to(reg: Registry, path: str, *, recheck: bool = False) -> str | None:
    """The sha the record at `path` points to now (None: gone); meta re-read with `recheck`."""
    kind, _, entry = path.partition("/")
    if kind == FRAMES:
        return layout.frame_sha(path)
    if kind == NAMES:
        try:
            return reg.read_name(entry)
        except errors.InvalidNameError:
            raise _refused(reg.root / path, "not a valid name") from None
    sha = layout.meta_sha(path)
    try:
        if recheck and sha is not None:
            reg.meta(sha)
    except RefNotFoundError:
        return None
    except errors.CorruptRecordError:
        pass  # there, if unreadable: it still points to its object
    return sha


def referenced_objects(
    reg: Registry, changes: Sequence[Change], verify: Verify
) -> dict[str, set[str]]:
    """{path of each meta, frame and name record in `changes` (type-checked: `check_shapes`):
    what it needs at the destination first}, read at the source now: the objects it points
    to, verified (a frame stands for its parts; a name of a frame needs the frame record
    too). Left out: a record gone since the plan, one pruned with its object meanwhile (gc
    removes the record first), a name that moved meanwhile.

    Raises:
        IntegrityError: a bad name or frame, an object failing verification, or a record
            whose object is missing at the source while it stays.
    """
    needs: dict[str, set[str]] = {}
    for c in changes:
        kind, _, entry = c.path.partition("/")
        if c.is_delete or c.kind == "dir" or kind not in (META, NAMES, FRAMES) or "/" in entry:
            continue
        if kind == NAMES and layout.is_temp_name(entry):
            continue
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
            raise _refused(reg.root / c.path, f"points to {sha}, which is not in the registry")
    return needs

"""Registry tree primitives for `migrate`: list, copy, compare, verify and remove a tree.

Invariants:
- Listing is no-follow (`Registry.walk`): a symlink anywhere below the root, or an entry
  that is neither a file nor a directory, raises `IntegrityError`, so nothing outside the
  registry is ever read, copied or removed.
- A copy is durable (temp file, fsync, the source's mode and mtime, no-overwrite link,
  directory fsync) and re-read afterwards: `check_copies` compares every copied file with
  the bytes read from the source.
- `remove_tree` removes names first, then meta, then the rest, so an interrupted removal
  never leaves a name or meta record without its object.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry import fsutil, layout
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry

__all__ = [
    "JOURNALS",
    "OWN",
    "check_copies",
    "check_verifies",
    "copy_dir_modes",
    "copy_files",
    "list_tree",
    "read_in",
    "remove_tree",
    "replace_keeping",
    "write_order",
]

# Files that belong to the target registry itself, never compared with the source's.
OWN: Final = frozenset({layout.MARKER, layout.README, layout.MIGRATIONS_LOG})
# Append-only journals: a target copy taken earlier may hold a prefix of the source's.
JOURNALS: Final = frozenset({layout.NAMES_LOG, layout.MIRROR_LOG})


def write_order(rel: str) -> tuple[int, str]:
    """Write order for a merge: objects before what refers to them, journals last."""
    top = rel.split("/", 1)[0]
    rank = {
        layout.OBJECTS: 1,
        layout.META: 2,
        layout.MEASUREMENTS: 3,
        layout.PROBES: 3,
        layout.SNAPSHOTS: 3,
        layout.NAMES: 5,
    }
    if top in JOURNALS:
        return 6, rel
    return rank.get(top, 4 if "/" in rel else 0), rel


def list_tree(root: Path) -> tuple[list[str], list[str]]:
    """(directories, files) below `root`, relative, in write order; refuses any symlink
    and any entry that is neither a file nor a directory (never followed or copied).

    Lock files and stray temp files are not part of a registry's content and are skipped.
    """
    dirs: list[str] = []
    files: list[str] = []
    for rel, kind in Registry(root).walk():
        if kind in ("link", "other"):
            what = "symlink" if kind == "link" else "special file"
            raise IntegrityError(
                f"{root / rel}: {what} in the registry; refusing to migrate it", path=root / rel
            )
        parts = rel.split("/")
        in_locks = parts[0] == layout.LOCKS and len(parts) > 1
        if in_locks or any(layout.is_temp_name(p) for p in parts):
            continue
        (dirs if kind == "dir" else files).append(rel)
    dirs.sort()
    files.sort(key=write_order)
    return dirs, files


def _is_problem(kind: str, severity: str) -> bool:
    # Directory modes travel with the registry and verify keeps reporting them at the
    # target; they are the user's to fix and do not make the content unsafe to move.
    return severity == "problem" and kind != "insecure_mode"


def check_verifies(reg: Registry, what: str) -> list[str]:
    """Verify `reg`; raise on a problem, return the insecure-mode messages as warnings."""
    report = verify_registry(reg)
    problems = [f for f in report.findings if _is_problem(f.kind, f.severity)]
    if problems:
        first = problems[0]
        raise IntegrityError(
            f"{what} {reg.root} does not verify ({len(problems)} problems; first: "
            f"{first.kind} {first.path}: {first.message})"
        )
    return [f"{f.path}: {f.message}" for f in report.findings if f.kind == "insecure_mode"]


def read_in(path: Path, root: Path) -> bytes:
    return fsutil.read_nofollow(path, root=root)


def copy_files(
    source: Path,
    dest: Path,
    dirs: Sequence[str],
    files: Iterable[str],
    on_new: Callable[[Path], None],
) -> dict[str, str]:
    """Create missing directories and copy missing files; return {rel: sha256 of the bytes}."""
    for rel in dirs:
        path = dest / rel
        if not path.exists():
            path.mkdir()
            on_new(path)
    digests: dict[str, str] = {}
    for rel in files:
        data = fsutil.copy_durable(source / rel, dest / rel, root=source)
        on_new(dest / rel)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


def check_copies(dest: Path, digests: dict[str, str]) -> None:
    """Re-read every copied file at the target and compare with what the source held."""
    for rel, expected in digests.items():
        actual = hashlib.sha256(read_in(dest / rel, dest)).hexdigest()
        if actual != expected:
            raise IntegrityError(
                f"{dest / rel}: copy hashes to {actual}, the source to {expected}",
                path=dest / rel,
                expected=expected,
                actual=actual,
            )


def copy_dir_modes(source: Path, dest: Path, dirs: Sequence[str]) -> None:
    # Last, deepest first: a read-only source directory must not stop the copy into it.
    for rel in [*sorted(dirs, key=lambda d: d.count("/"), reverse=True), "."]:
        mode = stat.S_IMODE(os.lstat(source / rel).st_mode)
        os.chmod(dest / rel, mode)


def replace_keeping(path: Path, data: bytes, st: os.stat_result) -> None:
    """Atomically replace `path` with `data`, giving it the mode and mtime of `st`."""
    fsutil.replace_atomic(path, data, mode=stat.S_IMODE(st.st_mode))
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def remove_tree(root: Path, *, ordered: bool = True) -> None:
    """Remove a registry tree: names first, then meta, then everything else (`ordered`),
    so an interrupted removal never leaves a name or meta record without its object."""

    def writable_and_retry(func: Callable[..., object], path: str, _exc: object) -> None:
        # A read-only directory (copied modes) cannot lose entries until it is writable.
        parent = Path(path).parent
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IMODE(parent.lstat().st_mode) | stat.S_IWUSR | stat.S_IXUSR)
        func(path)

    if ordered:
        for sub in (layout.NAMES, layout.META):
            path = root / sub
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, onerror=writable_and_retry)
    try:
        shutil.rmtree(root, onerror=writable_and_retry)
    except OSError as exc:
        raise PrefixregError(
            f"could not remove {root} completely ({exc}); the migrated registry is complete",
            hint=f"remove {root} by hand",
        ) from None

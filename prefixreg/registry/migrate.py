"""`prefixreg migrate`: move a registry to a new path (by default the standard location).

The old layout kept the registry at `~/prefix-registry`; the standard location is the XDG
state directory (`prefixreg.registry.location`). A move is one of:

- `rename`: source and target on one filesystem and no registry at the target yet; one
  atomic `rename(2)`, then the target is verified (and renamed back if it does not).
- `copy`: across filesystems. Every file is copied durably (temp file, fsync, the source's
  mode and mtime, no-overwrite link, directory fsync) into a hidden staging directory next
  to the target; every copied file is re-read and compared with the bytes read from the
  source, the staging registry is verified, and only then is it renamed into place and
  the old tree removed.
- `merge`: the target already holds a registry that is a (possibly partial) copy of this
  one: every file there is byte-identical to the source's (journals may be a prefix of the
  source's). Missing files are added in write order (objects, meta, measurements, names,
  journals) and verified; an interrupted earlier migration is finished this way.

Invariants:
- A target that holds a *different* registry (files the source does not have, names or
  records that disagree, another role), or files without `REGISTRY.json`, is refused.
- The source must verify before anything moves (problems other than directory modes stop
  the move), and is locked while it is read so no name move or gc interleaves.
- Nothing half-written: on failure the source is untouched and whatever this run wrote at
  the target is removed (a staging directory, or the files a merge added).
- Historical records (measurements, probes, names.log, mirror.log) arrive byte-identical
  with their mtimes. `migrations.log` (JSON lines, at the new root) gains one line per move.
- Nothing written to the source during a copy or merge is lost. `add` and measurement
  writes do not take the lock, so before the source goes, it is listed again (under the
  lock) against a stat snapshot taken before the copy; whatever appeared or changed is
  copied across in write order and verified, until a listing finds nothing new. Then the
  source is renamed aside (a writer that still names the old path now fails instead of
  writing into a tree about to be removed), listed a last time, and only then removed. A
  file changed at both ends, or a source that keeps changing, stops the move with the
  source kept and nothing deleted.
- A symlinked source root is resolved first: the directory moves, not the link (which
  is left dangling, so a writer still configured with it fails instead of writing there).
- The old tree is removed only after the target verified, names first, then meta, then the
  rest, so even an interrupted removal never leaves a name pointing nowhere.
- `scan_references` only reads: it lists every file:line under the given directories that
  still names the old path (`~/...`, `$HOME/...`, systemd's `%h/...` forms included).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prefixreg.core.errors import PrefixregError, RegistryLocationError, UsageError
from prefixreg.core.jsonio import JSONObject, dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.catchup import retire_source, stats
from prefixreg.registry.clock import iso_utc, utc_now
from prefixreg.registry.layout import MARKER, MIGRATIONS_LOG
from prefixreg.registry.location import default_registry_path
from prefixreg.registry.refscan import StaleReference, scan_references
from prefixreg.registry.store import Registry
from prefixreg.registry.treecopy import (
    JOURNALS,
    OWN,
    check_copies,
    check_verifies,
    copy_dir_modes,
    copy_files,
    list_tree,
    read_in,
    remove_tree,
    replace_keeping,
)

__all__ = [
    "MIGRATIONS_LOG",
    "MigrationReport",
    "StaleReference",
    "migrate_registry",
    "scan_references",
]


Method = Literal["rename", "copy", "merge", "none"]


@dataclass(slots=True)
class MigrationReport:
    """What a migration did (or, in a dry run, would do)."""

    source: str
    target: str
    method: Method
    dry_run: bool
    objects: int = 0
    files: int = 0
    copied: int = 0
    stale: list[StaleReference] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> JSONObject:
        return {
            "source": self.source,
            "target": self.target,
            "method": self.method,
            "dry_run": self.dry_run,
            "objects": self.objects,
            "files": self.files,
            "copied": self.copied,
            "stale": [s.to_dict() for s in self.stale],
            "warnings": list(self.warnings),
        }


# ------------------------------------------------------------------------------- plan


def _conflicts(source: Path, target: Path, files: Sequence[str]) -> list[str]:
    """Why the registry at `target` is not a partial copy of the one at `source`."""
    src_marker = Registry(source).role
    dst = Registry(target)
    why: list[str] = []
    if dst.role != src_marker:
        why.append(f"its role is {dst.role}, the source's is {src_marker}")
    known = set(files)
    _dirs, target_files = list_tree(target)
    for rel in target_files:
        if rel in OWN:
            continue
        if rel not in known:
            why.append(f"{rel} is not in the source")
            continue
        theirs, ours = read_in(target / rel, target), read_in(source / rel, source)
        if theirs == ours or (rel in JOURNALS and ours.startswith(theirs)):
            continue
        why.append(f"{rel} differs from the source's")
    return why


def _same_filesystem(source: Path, target: Path) -> bool:
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return source.stat().st_dev == probe.stat().st_dev


# ------------------------------------------------------------------------------- move


def migrate_registry(
    old: Path | str,
    new: Path | str | None = None,
    *,
    scan: Sequence[Path | str] = (),
    dry_run: bool = False,
) -> MigrationReport:
    """Move the registry at `old` to `new` (default: the standard location), verified.

    Args:
        scan: directories (or files) to search for lines still naming `old`.
        dry_run: decide and report what would happen; change nothing.

    Raises:
        UsageError / RegistryLocationError: no registry at `old`, same or nested paths, a
            target that holds a different registry or unmarked files.
        IntegrityError: the source (or the result) does not verify, or holds a symlink.
        LockTimeoutError: another process holds the source's (or target's) lock.
    """
    given = Path(old).expanduser().absolute()
    # A symlinked root: move the directory it names (a rename would move only the link).
    source = given.resolve() if given.is_symlink() else given
    target = (Path(new).expanduser() if new is not None else default_registry_path()).absolute()
    report = MigrationReport(source=str(given), target=str(target), method="none", dry_run=dry_run)
    if not (source / MARKER).exists() and not (source / MARKER).is_symlink():
        if not source.exists() and _migrated_from(target, given):
            # Already moved: the user came back for --scan (or re-ran the command).
            report.warnings.append(f"nothing to move: {given} is gone; {target} is a registry")
            report.stale = scan_references(given, scan, skip=(target,))
            return report
        raise RegistryLocationError(f"no registry at {given} (no {MARKER})")
    src_real, dst_real = source.resolve(), target.resolve()
    if src_real == dst_real:
        raise UsageError(f"{source} and {target} are the same directory")
    if dst_real.is_relative_to(src_real) or src_real.is_relative_to(dst_real):
        raise UsageError(f"{source} and {target} are nested; pick a target outside the source")
    if target.is_symlink() and target.is_dir():
        target = target.resolve()  # the user pointed the location elsewhere: move there
        report.target = str(target)
    src = Registry(source)
    source_warnings = check_verifies(src, "the source registry")

    if dry_run:
        _dirs, files = list_tree(source)
        report.method = _plan(source, target, files)
        report.warnings.extend(source_warnings)
    else:
        with src.lock():
            dirs, files = list_tree(source)
            before = stats(source, files)  # what later writes are told apart from
            report.method = _plan(source, target, files)
            if report.method == "rename" and not _move_by_rename(source, target):
                report.method = "copy"  # EXDEV after all (a bind mount, an overlay)
            if report.method == "copy":
                warnings = _move_by_copy(source, target, dirs, files)  # verified in staging
            else:
                if report.method == "merge":
                    with Registry(target).lock():
                        report.copied = _move_by_merge(source, target, dirs, files)
                try:
                    warnings = check_verifies(Registry(target), "the migrated registry")
                except BaseException:
                    if report.method == "rename":
                        target.rename(source)  # put it back exactly where it was
                    raise
            report.warnings.extend(warnings)
            retired: Path | None = None
            late: list[str] = []
            if report.method != "rename":
                # rename(2) moved everything at once; a copy or merge took time, during
                # which `add` (no lock) may have written to the source.
                late, retired = retire_source(source, target, before)
                known = set(files)
                files = [*files, *(rel for rel in late if rel not in known)]
            _journal(given, target, report, files)
            if retired is not None:
                remove_tree(retired)
    report.files = len(files)
    report.objects = sum(1 for f in files if layout.object_sha(f) is not None)
    if report.method == "copy":
        report.copied = len(files)
    elif report.method == "merge":
        report.copied += len(late)
    if source != given:
        report.warnings.append(
            f"{given} is a symlink to {source}: moved {source}; the link now dangles "
            "(remove it once nothing uses it)"
        )
    report.stale = scan_references(given, scan, skip=(target,))
    return report


def _migrated_from(target: Path, source: Path) -> bool:
    """True when `migrations.log` at `target` records a move from `source`."""
    try:
        raw = fsutil.read_nofollow(target / MIGRATIONS_LOG, root=target)
    except (OSError, PrefixregError):
        return False
    for line in raw.splitlines():
        try:
            entry = loads_object(line)
        except PrefixregError:
            continue
        if entry.get("from") == str(source):
            return True
    return False


def _plan(source: Path, target: Path, files: Sequence[str]) -> Method:
    """Pick rename, copy or merge for this target, or refuse it."""
    if target.is_symlink() and not target.is_dir():
        raise RegistryLocationError(f"{target}: a dangling symlink; refusing to write through it")
    if target.exists() and not target.is_dir():
        raise RegistryLocationError(f"{target}: is a file, not a directory")
    if (target / MARKER).exists() or (target / MARKER).is_symlink():
        why = _conflicts(source, target, files)
        if why:
            raise RegistryLocationError(
                f"{target} holds a different registry: "
                + "; ".join(why[:3])
                + (f" (and {len(why) - 3} more)" if len(why) > 3 else ""),
                hint="pick another --to, or move that registry away first",
            )
        return "merge"
    if target.is_dir() and any(target.iterdir()):
        raise RegistryLocationError(
            f"{target}: holds files but no {MARKER}; refusing to migrate into it",
            hint="pick an empty or new directory with --to",
        )
    return "rename" if _same_filesystem(source, target) else "copy"


def _move_by_rename(source: Path, target: Path) -> bool:
    """rename(2) the tree (an empty target directory is replaced); False on EXDEV."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        source.rename(target)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            return False
        raise
    fsutil.fsync_dir(target.parent)
    if source.parent != target.parent:
        fsutil.fsync_dir(source.parent)
    return True


def _move_by_copy(
    source: Path, target: Path, dirs: Sequence[str], files: Sequence[str]
) -> list[str]:
    """Copy into a staging directory, verify it, rename it into place; its mode warnings."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.migrating-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        (staging / layout.LOCKS).mkdir(exist_ok=True)
        digests = copy_files(source, staging, dirs, files, lambda _p: None)
        copy_dir_modes(source, staging, dirs)
        check_copies(staging, digests)
        warnings = check_verifies(Registry(staging), "the copied registry")
        # rename(2) replaces an empty target directory atomically; a target that gained
        # files meanwhile makes it fail with ENOTEMPTY and nothing is lost.
        staging.rename(target)
    except BaseException:
        remove_tree(staging, ordered=False)
        raise
    fsutil.fsync_dir(target.parent)
    return warnings


def _move_by_merge(source: Path, target: Path, dirs: Sequence[str], files: Sequence[str]) -> int:
    """Add what the target lacks (and extend journals); undo all of it on failure."""
    added: list[Path] = []
    replaced: list[tuple[Path, bytes, os.stat_result]] = []
    missing = [rel for rel in files if not (target / rel).exists() and rel not in OWN]
    try:
        digests = copy_files(source, target, dirs, missing, added.append)
        for rel in sorted(JOURNALS):
            src_path, dst_path = source / rel, target / rel
            if rel in missing or not src_path.exists() or not dst_path.exists():
                continue
            ours = read_in(src_path, source)
            theirs = read_in(dst_path, target)
            if ours == theirs:
                continue
            old_st = dst_path.lstat()
            replaced.append((dst_path, theirs, old_st))
            replace_keeping(dst_path, ours, src_path.lstat())
            digests[rel] = hashlib.sha256(ours).hexdigest()
        _merge_migrations_log(source, target)
        check_copies(target, digests)
    except BaseException:
        for path in reversed(added):
            with contextlib.suppress(OSError):
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink()
        for path, data, st in replaced:
            with contextlib.suppress(OSError):
                replace_keeping(path, data, st)
        raise
    return len(missing) + len(replaced)


def _merge_migrations_log(source: Path, target: Path) -> None:
    """Keep the target's migration history and add the source's lines it lacks."""
    src_log, dst_log = source / MIGRATIONS_LOG, target / MIGRATIONS_LOG
    if not src_log.exists():
        return
    ours = read_in(src_log, source)
    if not dst_log.exists():
        fsutil.copy_durable(src_log, dst_log, root=source)
        return
    theirs = read_in(dst_log, target)
    have = set(theirs.splitlines())
    for line in ours.splitlines():
        if line.strip() and line not in have:
            fsutil.append_line(dst_log, line)


def _journal(source: Path, target: Path, report: MigrationReport, files: Sequence[str]) -> None:
    from prefixreg.core.version import package_version

    line = {
        "at": iso_utc(utc_now()),
        "from": str(source),
        "to": str(target),
        "method": report.method,
        "objects": sum(1 for f in files if layout.object_sha(f) is not None),
        "files": len(files),
        "prefixreg": package_version(),
    }
    fsutil.append_line(target / MIGRATIONS_LOG, dumps_canonical(line))

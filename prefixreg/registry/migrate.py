"""`prefixreg migrate`: move a registry to a new path (default: the XDG state directory, where
`~/prefix-registry` of the old layout belongs), and find or repoint lines naming the old one.

A move is a `rename` (one filesystem, no registry at the target: renamed back if the target
does not verify), a `copy` (into a hidden staging directory next to the target, compared with
what was read, verified, then renamed into place) or a `merge` (the target holds a partial
copy of this registry, byte-identical where it has the file, journals possibly a prefix:
what it lacks is added in write order).

Invariants:
- A target holding a different registry, or files without `REGISTRY.json`, is refused.
- The source must verify first (directory modes aside) and is locked while read; writes
  that take no lock (`add`, measurements) are caught up before it goes (`treecopy`).
- Nothing half-written: on failure the source is untouched and what this run wrote at the
  target is removed. History arrives byte-identical with its mtimes; `migrations.log` at the
  new root gains one line per move.
- A symlinked source root is resolved: the directory moves, the link is left dangling. The
  old tree is removed only after the target verified, names first, then meta.
- A hand-built registry (no `REGISTRY.json`) is adopted only with `repoint`
  (`repointing.adopt`); the lines naming the old path are listed (`--scan`) or repointed by
  `repointing`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from prefixreg.core.errors import PrefixregError, RegistryLocationError, UsageError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout, treecopy
from prefixreg.registry.layout import MARKER, MIGRATIONS_LOG
from prefixreg.registry.location import default_registry_path
from prefixreg.registry.repointing import Repointed, StaleReference, adopt, scan_references, survey
from prefixreg.registry.repointing import repoint as repoint_files
from prefixreg.registry.store import Registry

Method = Literal["rename", "copy", "merge", "adopt", "none"]
Say = Callable[[str], None]


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
    repointed: list[Repointed] = field(default_factory=list)
    legacy: int = 0
    kept: list[str] = field(default_factory=list)

    to_dict = asdict


def migrate_registry(
    old: Path | str,
    new: Path | str | None = None,
    *,
    scan: Sequence[Path | str] = (),
    dry_run: bool = False,
    repoint: bool = False,
    progress: Say | None = None,
) -> MigrationReport:
    """Move the registry at `old` to `new` (default: the standard location), verified; list
    the lines under `scan` still naming `old`; `repoint`: adopt a hand-built registry. Raises:
    UsageError, RegistryLocationError (no registry at `old`, same or nested paths, a target
    holding another registry or unmarked files); IntegrityError (the source or the result
    does not verify, or holds a symlink); LockTimeoutError."""
    given = Path(old).expanduser().absolute()
    # A symlinked root: move the directory it names (a rename would move only the link).
    source = given.resolve() if given.is_symlink() else given
    target = (Path(new).expanduser() if new is not None else default_registry_path()).absolute()
    if repoint and (brk := _line_break(str(target))) is not None:  # it goes into README lines
        why = f"--to {str(target)!r} holds a line break ({brk})"
        raise UsageError(f"{why}: it cannot be repointed into README and bin/ lines; refused")
    report = MigrationReport(source=str(given), target=str(target), method="none", dry_run=dry_run)
    marked = os.path.lexists(source / MARKER)
    if not marked and not (repoint and source.is_dir()):
        if not source.exists() and _migrated_from(target, given):
            # Already moved: the user came back for --scan (or re-ran the command).
            report.warnings.append(f"nothing to move: {given} is gone; {target} is a registry")
            report.stale = scan_references(given, scan, skip=(target,))
            return report
        hint: str | None = f"a hand-built registry: adopt it with --repoint ({layout.FORMAT_DOC})"
        if not (source / layout.OBJECTS).is_dir():
            hint = None
        raise RegistryLocationError(f"no registry at {given} (no {MARKER})", hint=hint)
    src_real, dst_real = source.resolve(), target.resolve()
    if src_real == dst_real:
        raise UsageError(f"{source} and {target} are the same directory")
    if dst_real.is_relative_to(src_real) or src_real.is_relative_to(dst_real):
        raise UsageError(f"{source} and {target} are nested; pick a target outside the source")
    if target.is_symlink() and target.is_dir():
        target = target.resolve()  # the user pointed the location elsewhere: move there
        report.target = str(target)
    say = progress or (lambda _msg: None)
    if not marked:
        _adopt(given, source, target, report, progress)
        report.stale = scan_references(given, scan, skip=(target,))
        return report
    src = Registry(source)
    say(f"verifying the registry at {source}")
    source_warnings = treecopy.check_verifies(src, "the source registry")
    late: list[str] = []
    if dry_run:
        files = treecopy.list_tree(source)[1]
        report.method = _plan(source, target, files)
        report.warnings = source_warnings
    else:
        with src.lock():
            dirs, files = treecopy.list_tree(source)
            before = treecopy.stats(source, files)  # what later writes are told apart from
            report.method = _plan(source, target, files)
            say(f"moving {len(files)} files to {target} by {report.method}")
            if report.method == "rename" and not _move_by_rename(source, target):
                report.method = "copy"  # EXDEV after all (a bind mount, an overlay)
            if report.method == "copy":
                report.warnings += _move_by_copy(source, target, dirs, files, say)
            else:
                if report.method == "merge":
                    with Registry(target).lock():
                        report.copied = _move_by_merge(source, target, dirs, files, say)
                say(f"verifying the registry at {target}")
                try:
                    moved = Registry(target)
                    report.warnings += treecopy.check_verifies(moved, "the migrated registry")
                except BaseException:
                    if report.method == "rename":
                        target.rename(source)  # put it back exactly where it was
                    raise
            retired: Path | None = None
            if report.method != "rename":
                # rename(2) moved everything at once; a copy or merge took time, during
                # which `add` (no lock) may have written to the source.
                late, retired = treecopy.retire_source(source, target, before)
                files = list(dict.fromkeys([*files, *late]))
            _journal(given, target, report.method, files)
            if retired is not None:
                treecopy.remove_tree(retired)
    report.files = len(files)
    report.objects = sum(1 for f in files if layout.object_sha(f) is not None)
    report.copied = len(files) if report.method == "copy" else report.copied + len(late)
    if source != given:
        dangles = "the link now dangles (remove it once nothing uses it)"
        report.warnings.append(f"{given} is a symlink to {source}: moved {source}; {dangles}")
    if repoint:
        where = source if dry_run else target  # a dry run reads what it would repoint
        report.repointed = repoint_files(where, given, target, write=not dry_run)
    if scan:
        say(f"scanning {', '.join(map(str, scan))} for lines naming {given}")
    report.stale = scan_references(given, scan, skip=(target,))
    return report


def _line_break(text: str) -> str | None:
    """The first character of `text` that splits a line (`str.splitlines`: LF, CR, U+2028,
    ...) as an escape, or None: a repointed line must stay one line."""
    for ch in text:
        if len(f"a{ch}b".splitlines()) > 1:
            return ascii(ch)
    return None


def _adopt(
    given: Path, source: Path, target: Path, report: MigrationReport, progress: Say | None
) -> None:
    """`repointing.adopt` at `target`, then retire the source as a copy does; a dry run
    only surveys."""
    surveyed = survey(source, progress=progress)
    files = surveyed[1]
    if os.path.lexists(target / MARKER):
        why = f"{target} holds a registry; refusing to adopt {given} into it"
        raise RegistryLocationError(why, hint="adopt into a new or empty directory with --to")
    _plan(source, target, files)  # refuses a file, a dangling link, unmarked files
    report.method, report.legacy, report.kept = "adopt", len(surveyed[2]), surveyed[3]
    report.files = len(files)
    report.objects = sum(1 for f in files if layout.object_sha(f) is not None)
    if report.dry_run:
        report.repointed = repoint_files(source, given, target, write=False)
        return
    before = treecopy.stats(source, files)
    report.warnings, report.repointed = adopt(source, given, target, surveyed)
    try:
        late, retired = treecopy.retire_source(source, target, before)
    except BaseException as exc:  # the source stays the one copy: a re-run adopts it anew
        treecopy.remove_tree(target, ordered=False)
        if isinstance(exc, PrefixregError):
            why = f"{source} kept changing during the adoption; adopted nothing (it is as it was)"
            hint = "stop whatever writes to it, then run migrate --repoint again"
            raise PrefixregError(why, hint=hint) from None
        raise
    report.copied = len(files) + len(late)
    _journal(given, target, "adopt", [*files, *late])
    if retired is not None:
        treecopy.remove_tree(retired)


def _migrated_from(target: Path, source: Path) -> bool:
    """True when `migrations.log` at `target` records a move from `source`."""
    try:
        raw = fsutil.read_nofollow(target / MIGRATIONS_LOG, root=target)
    except (OSError, PrefixregError):
        return False
    for line in raw.splitlines():
        with contextlib.suppress(PrefixregError):
            if loads_object(line).get("from") == str(source):
                return True
    return False


def _conflicts(source: Path, target: Path, files: Sequence[str]) -> list[str]:
    """Why the registry at `target` is not a partial copy of the one at `source`."""
    src_role, dst_role = Registry(source).role, Registry(target).role
    why = [] if dst_role == src_role else [f"its role is {dst_role}, the source's is {src_role}"]
    known = set(files)
    for rel in [rel for rel in treecopy.list_tree(target)[1] if rel not in treecopy.OWN]:
        if rel not in known:
            why.append(f"{rel} is not in the source")
            continue
        relation = treecopy.compare(source / rel, target / rel, root=source, their_root=target)
        if relation != "same" and not (rel in layout.JOURNALS and relation == "prefix"):
            why.append(f"{rel} differs from the source's")
    return why


def _same_filesystem(source: Path, target: Path) -> bool:
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    return source.stat().st_dev == probe.stat().st_dev


def _plan(source: Path, target: Path, files: Sequence[str]) -> Method:
    """Pick rename, copy or merge for this target, or refuse it."""
    if target.is_symlink() and not target.is_dir():
        raise RegistryLocationError(f"{target}: a dangling symlink; refusing to write through it")
    if target.exists() and not target.is_dir():
        raise RegistryLocationError(f"{target}: is a file, not a directory")
    if os.path.lexists(target / MARKER):
        why = _conflicts(source, target, files)
        if why:
            more = f" (and {len(why) - 3} more)" if len(why) > 3 else ""
            message = f"{target} holds a different registry: {'; '.join(why[:3])}{more}"
            hint = "pick another --to, or move that registry away first"
            raise RegistryLocationError(message, hint=hint)
        return "merge"
    if target.is_dir() and any(target.iterdir()):
        message = f"{target}: holds files but no {MARKER}; refusing to migrate into it"
        raise RegistryLocationError(message, hint="pick an empty or new directory with --to")
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
    source: Path, target: Path, dirs: Sequence[str], files: Sequence[str], say: Say
) -> list[str]:
    """Copy into a staging directory, verify it, rename it into place; its mode warnings."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.migrating-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        copied = treecopy.sync(source, staging, files, dirs=dirs, progress=say)
        treecopy.check_copies(staging, copied)
        staging.chmod(source.stat().st_mode & 0o7777)
        say(f"verifying the copy at {staging}")
        warnings = treecopy.check_verifies(Registry(staging), "the copied registry")
        # rename(2) replaces an empty target directory atomically; a target that gained
        # files meanwhile makes it fail with ENOTEMPTY and nothing is lost.
        staging.rename(target)
    except BaseException:
        treecopy.remove_tree(staging, ordered=False)
        raise
    fsutil.fsync_dir(target.parent)
    return warnings


def _move_by_merge(
    source: Path, target: Path, dirs: Sequence[str], files: Sequence[str], say: Say
) -> int:
    """Add what the target lacks (and extend its journals); undo all of it on failure."""
    lacking = [rel for rel in files if rel in layout.JOURNALS or not (target / rel).exists()]
    wanted = [rel for rel in lacking if rel not in treecopy.OWN]
    undo = treecopy.Undo()
    try:
        digests = treecopy.sync(source, target, wanted, dirs=dirs, undo=undo, progress=say)
        _merge_migrations_log(source, target)
        treecopy.check_copies(target, digests)
    except BaseException:
        undo.rollback()
        raise
    return len(digests)


def _merge_migrations_log(source: Path, target: Path) -> None:
    """Keep the target's migration history and add the source's lines it lacks."""
    src_log, dst_log = source / MIGRATIONS_LOG, target / MIGRATIONS_LOG
    if not src_log.exists():
        return
    if not dst_log.exists():
        fsutil.copy_durable(src_log, dst_log, root=source)
        return
    have = set(fsutil.read_nofollow(dst_log, root=target).splitlines())
    for line in fsutil.read_nofollow(src_log, root=source).splitlines():
        if line.strip() and line not in have:
            fsutil.append_line(dst_log, line)


def _journal(source: Path, target: Path, method: Method, files: Sequence[str]) -> None:
    from prefixreg.core.version import package_version

    objects = sum(1 for f in files if layout.object_sha(f) is not None)
    line: dict[str, object] = {"at": layout.iso_utc(layout.utc_now()), "method": method}
    line |= {"from": str(source), "to": str(target), "objects": objects, "files": len(files)}
    line["prefixreg"] = package_version()
    fsutil.append_line(target / MIGRATIONS_LOG, dumps_canonical(line))

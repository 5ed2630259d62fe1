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
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import IntegrityError, PrefixregError, RegistryLocationError, UsageError
from prefixreg.core.jsonio import JSONObject, dumps_canonical, loads_object
from prefixreg.registry import fsutil
from prefixreg.registry.location import default_registry_path
from prefixreg.registry.store import MARKER, Registry, iso_utc, utc_now

__all__ = [
    "MIGRATIONS_LOG",
    "MigrationReport",
    "StaleReference",
    "migrate_registry",
    "scan_references",
]

MIGRATIONS_LOG: Final = "migrations.log"
# Files that belong to the target registry itself, never compared with the source's.
_OWN: Final = frozenset({MARKER, "README.md", MIGRATIONS_LOG})
# Append-only journals: a target copy taken earlier may hold a prefix of the source's.
_JOURNALS: Final = frozenset({"names.log", "mirror.log"})
_SCAN_SKIP_DIRS: Final = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__"})
_SCAN_MAX_BYTES: Final = 8 << 20

Method = Literal["rename", "copy", "merge", "none"]


@dataclass(frozen=True, slots=True)
class StaleReference:
    """One line of a file that still names the old registry path."""

    path: str
    line: int
    text: str

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "line": self.line, "text": self.text}


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


def _order(rel: str) -> tuple[int, str]:
    """Write order for a merge: objects before what refers to them, journals last."""
    top = rel.split("/", 1)[0]
    rank = {"objects": 1, "meta": 2, "measurements": 3, "probes": 3, "names": 5}
    if top in _JOURNALS:
        return 6, rel
    return rank.get(top, 4 if "/" in rel else 0), rel


def _list_tree(root: Path) -> tuple[list[str], list[str]]:
    """(directories, files) below `root`, relative, in write order; refuses any symlink.

    Lock files and stray temp files are not part of a registry's content and are skipped.
    """
    dirs: list[str] = []
    files: list[str] = []
    for directory, dirnames, filenames in os.walk(root):
        base = Path(directory)
        rel_dir = base.relative_to(root)
        for name in [*dirnames, *filenames]:
            if (base / name).is_symlink():
                raise IntegrityError(
                    f"{base / name}: symlink in the registry; refusing to migrate it",
                    path=base / name,
                )
        dirnames[:] = sorted(d for d in dirnames if not fsutil.is_temp_name(d))
        for d in dirnames:
            dirs.append(str(rel_dir / d))
        if str(rel_dir) == ".locks":
            continue
        files.extend(str(rel_dir / f) for f in filenames if not fsutil.is_temp_name(f))
    files = [f.removeprefix("./") for f in files]
    dirs = [d.removeprefix("./") for d in dirs]
    files.sort(key=_order)
    return dirs, files


def _is_problem(kind: str, severity: str) -> bool:
    # Directory modes travel with the registry and verify keeps reporting them at the
    # target; they are the user's to fix and do not make the content unsafe to move.
    return severity == "problem" and kind != "insecure_mode"


def _check_verifies(reg: Registry, what: str) -> list[str]:
    """Verify `reg`; raise on a problem, return the insecure-mode messages as warnings."""
    report = reg.verify()
    problems = [f for f in report.findings if _is_problem(f.kind, f.severity)]
    if problems:
        first = problems[0]
        raise IntegrityError(
            f"{what} {reg.root} does not verify ({len(problems)} problems; first: "
            f"{first.kind} {first.path}: {first.message})"
        )
    return [f"{f.path}: {f.message}" for f in report.findings if f.kind == "insecure_mode"]


def _read(path: Path, root: Path) -> bytes:
    return fsutil.read_nofollow(path, root=root)


def _conflicts(source: Path, target: Path, files: Sequence[str]) -> list[str]:
    """Why the registry at `target` is not a partial copy of the one at `source`."""
    src_marker = Registry(source).role
    dst = Registry(target)
    why: list[str] = []
    if dst.role != src_marker:
        why.append(f"its role is {dst.role}, the source's is {src_marker}")
    known = set(files)
    _dirs, target_files = _list_tree(target)
    for rel in target_files:
        if rel in _OWN:
            continue
        if rel not in known:
            why.append(f"{rel} is not in the source")
            continue
        theirs, ours = _read(target / rel, target), _read(source / rel, source)
        if theirs == ours or (rel in _JOURNALS and ours.startswith(theirs)):
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
    source_warnings = _check_verifies(src, "the source registry")

    if dry_run:
        _dirs, files = _list_tree(source)
        report.method = _plan(source, target, files)
        report.warnings.extend(source_warnings)
    else:
        with src.lock():
            dirs, files = _list_tree(source)
            before = _stats(source, files)  # what later writes are told apart from
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
                    warnings = _check_verifies(Registry(target), "the migrated registry")
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
                late, retired = _retire_source(source, target, before)
                known = set(files)
                files = [*files, *(rel for rel in late if rel not in known)]
            _journal(given, target, report, files)
            if retired is not None:
                _remove_tree(retired)
    report.files = len(files)
    report.objects = sum(1 for f in files if f.startswith("objects/"))
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


def _copy_files(
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


def _check_copies(dest: Path, digests: dict[str, str]) -> None:
    """Re-read every copied file at the target and compare with what the source held."""
    for rel, expected in digests.items():
        actual = hashlib.sha256(_read(dest / rel, dest)).hexdigest()
        if actual != expected:
            raise IntegrityError(
                f"{dest / rel}: copy hashes to {actual}, the source to {expected}",
                path=dest / rel,
                expected=expected,
                actual=actual,
            )


def _copy_dir_modes(source: Path, dest: Path, dirs: Sequence[str]) -> None:
    # Last, deepest first: a read-only source directory must not stop the copy into it.
    for rel in [*sorted(dirs, key=lambda d: d.count("/"), reverse=True), "."]:
        mode = stat.S_IMODE(os.lstat(source / rel).st_mode)
        os.chmod(dest / rel, mode)


def _move_by_copy(
    source: Path, target: Path, dirs: Sequence[str], files: Sequence[str]
) -> list[str]:
    """Copy into a staging directory, verify it, rename it into place; its mode warnings."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.migrating-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        (staging / ".locks").mkdir(exist_ok=True)
        digests = _copy_files(source, staging, dirs, files, lambda _p: None)
        _copy_dir_modes(source, staging, dirs)
        _check_copies(staging, digests)
        warnings = _check_verifies(Registry(staging), "the copied registry")
        # rename(2) replaces an empty target directory atomically; a target that gained
        # files meanwhile makes it fail with ENOTEMPTY and nothing is lost.
        staging.rename(target)
    except BaseException:
        _remove_tree(staging, ordered=False)
        raise
    fsutil.fsync_dir(target.parent)
    return warnings


def _move_by_merge(source: Path, target: Path, dirs: Sequence[str], files: Sequence[str]) -> int:
    """Add what the target lacks (and extend journals); undo all of it on failure."""
    added: list[Path] = []
    replaced: list[tuple[Path, bytes, os.stat_result]] = []
    missing = [rel for rel in files if not (target / rel).exists() and rel not in _OWN]
    try:
        digests = _copy_files(source, target, dirs, missing, added.append)
        for rel in sorted(_JOURNALS):
            src_path, dst_path = source / rel, target / rel
            if rel in missing or not src_path.exists() or not dst_path.exists():
                continue
            ours = _read(src_path, source)
            theirs = _read(dst_path, target)
            if ours == theirs:
                continue
            old_st = dst_path.lstat()
            replaced.append((dst_path, theirs, old_st))
            _replace_keeping(dst_path, ours, src_path.lstat())
            digests[rel] = hashlib.sha256(ours).hexdigest()
        _merge_migrations_log(source, target)
        _check_copies(target, digests)
    except BaseException:
        for path in reversed(added):
            with contextlib.suppress(OSError):
                if path.is_dir():
                    path.rmdir()
                else:
                    path.unlink()
        for path, data, st in replaced:
            with contextlib.suppress(OSError):
                _replace_keeping(path, data, st)
        raise
    return len(missing) + len(replaced)


def _replace_keeping(path: Path, data: bytes, st: os.stat_result) -> None:
    """Atomically replace `path` with `data`, giving it the mode and mtime of `st`."""
    fsutil.replace_atomic(path, data, mode=stat.S_IMODE(st.st_mode))
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _merge_migrations_log(source: Path, target: Path) -> None:
    """Keep the target's migration history and add the source's lines it lacks."""
    src_log, dst_log = source / MIGRATIONS_LOG, target / MIGRATIONS_LOG
    if not src_log.exists():
        return
    ours = _read(src_log, source)
    if not dst_log.exists():
        fsutil.copy_durable(src_log, dst_log, root=source)
        return
    theirs = _read(dst_log, target)
    have = set(theirs.splitlines())
    for line in ours.splitlines():
        if line.strip() and line not in have:
            fsutil.append_line(dst_log, line)


# ----------------------------------------------------------------- writes during a move

Stat = tuple[int, int, int]  # size, mtime_ns, inode: any write changes at least one
_CATCH_UP_ROUNDS: Final = 10


def _stats(root: Path, files: Iterable[str]) -> dict[str, Stat]:
    out: dict[str, Stat] = {}
    for rel in files:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(root / rel)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _retire_source(source: Path, target: Path, before: dict[str, Stat]) -> tuple[list[str], Path]:
    """Copy what was written to the source during the move, then rename the source aside.

    Runs under the source's lock, after the target verified. Each round lists the source
    again and copies what appeared or changed since `before` (a stat snapshot taken before
    the copy); rounds repeat until one finds nothing. The source is then renamed to a
    hidden sibling (atomic; a writer that still uses the old path fails from then on
    instead of writing into a tree about to go) and caught up a last time from there. A
    source that cannot be renamed (a mount point) is removed in place after the quiet round.

    Returns:
        The relative paths copied across, and where the source now is (to be removed).

    Raises:
        PrefixregError / IntegrityError: a file changed at both ends, or the source kept
            changing; the source is kept where it was and nothing is deleted.
    """
    target_state = _stats(target, _list_tree(target)[1])
    late: list[str] = []
    for _ in range(_CATCH_UP_ROUNDS):
        copied = _catch_up(source, target, before, target_state)
        late += copied
        if not copied:
            break
    else:
        raise PrefixregError(
            f"{source} kept changing during the move; kept it (the copy at {target} is "
            "complete up to now)",
            hint="stop whatever writes to it, then run migrate again (it finishes the move)",
        )
    retired = source.with_name(f".{source.name}.migrated-{secrets.token_hex(4)}")
    try:
        source.rename(retired)
    except OSError:
        # A mount point cannot be renamed (EBUSY, EXDEV): remove it in place; the last
        # round found nothing new, under the lock.
        return late, source
    fsutil.fsync_dir(source.parent)
    try:
        late += _catch_up(retired, target, before, target_state)
    except BaseException:
        retired.rename(source)  # put it back: nothing is deleted
        fsutil.fsync_dir(source.parent)
        raise
    return late, retired


def _catch_up(
    source: Path, target: Path, before: dict[str, Stat], target_state: dict[str, Stat]
) -> list[str]:
    """One round: copy files new or changed at `source` since `before` to `target`.

    `before` and `target_state` are updated, so the next round sees only newer writes.
    Files new at the source are copied (no overwrite); changed ones replace the target's
    copy only where that is a known kind of write: a journal the target holds a prefix of
    (append-only), a meta record the target left alone since the move (a new note).
    Anything else that differs is a conflict. Objects are immutable: a changed object
    stat with the same bytes is a re-add (its mtime is carried over); different bytes are
    an integrity failure.
    """
    dirs, files = _list_tree(source)
    now = _stats(source, files)
    changed = [rel for rel in files if rel not in _OWN and now.get(rel) != before.get(rel)]
    for rel in dirs:
        if not (target / rel).exists():
            (target / rel).mkdir()
            os.chmod(target / rel, stat.S_IMODE(os.lstat(source / rel).st_mode))
    digests: dict[str, str] = {}
    for rel in changed:
        dst = target / rel
        if not dst.exists():
            data = fsutil.copy_durable(source / rel, dst, root=source)
            digests[rel] = hashlib.sha256(data).hexdigest()
            continue
        ours, theirs = _read(source / rel, source), _read(dst, target)
        src_st = (source / rel).lstat()
        if ours == theirs:
            if src_st.st_mtime_ns > dst.lstat().st_mtime_ns:
                os.utime(dst, ns=(src_st.st_atime_ns, src_st.st_mtime_ns), follow_symlinks=False)
        elif rel.startswith("objects/"):
            raise IntegrityError(
                f"{source / rel}: an object's bytes changed during the move; kept {source}",
                path=source / rel,
            )
        elif (rel in _JOURNALS and ours.startswith(theirs)) or (
            rel.startswith("meta/") and target_state.get(rel) == _stats(target, [rel]).get(rel)
        ):
            # A journal the source appended to, or a meta record whose note changed
            # (replaced at the source, untouched at the target since the move).
            _replace_keeping(dst, ours, src_st)
            digests[rel] = hashlib.sha256(ours).hexdigest()
        else:
            raise PrefixregError(
                f"{rel} changed both at {source} and at {target} during the move; kept {source}",
                hint="compare the two, then run migrate again",
            )
    if digests:
        _check_copies(target, digests)
        _check_verifies(Registry(target), "the migrated registry (after late writes)")
    before.update(now)
    target_state.update(_stats(target, changed))
    return sorted(digests, key=_order)


def _journal(source: Path, target: Path, report: MigrationReport, files: Sequence[str]) -> None:
    from prefixreg.core.version import package_version

    line = {
        "at": iso_utc(utc_now()),
        "from": str(source),
        "to": str(target),
        "method": report.method,
        "objects": sum(1 for f in files if f.startswith("objects/")),
        "files": len(files),
        "prefixreg": package_version(),
    }
    fsutil.append_line(target / MIGRATIONS_LOG, dumps_canonical(line))


def _remove_tree(root: Path, *, ordered: bool = True) -> None:
    """Remove a registry tree: names first, then meta, then everything else (`ordered`),
    so an interrupted removal never leaves a name or meta record without its object."""

    def writable_and_retry(func: Callable[..., object], path: str, _exc: object) -> None:
        # A read-only directory (copied modes) cannot lose entries until it is writable.
        parent = Path(path).parent
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IMODE(parent.lstat().st_mode) | stat.S_IWUSR | stat.S_IXUSR)
        func(path)

    if ordered:
        for sub in ("names", "meta"):
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


# ------------------------------------------------------------------------------- scan


def _path_forms(old: Path) -> list[str]:
    """The spellings a config file might use for `old`."""
    forms = {str(old)}
    with contextlib.suppress(OSError):
        forms.add(str(old.resolve()))
    home = Path.home()
    for base in {home, home.resolve()}:
        try:
            rel = old.relative_to(base)
        except ValueError:
            continue
        for prefix in ("~", "$HOME", "${HOME}", "%h"):
            forms.add(f"{prefix}/{rel}")
    return sorted(forms, key=len, reverse=True)


def scan_references(
    old: Path | str, dirs: Sequence[Path | str], *, skip: Sequence[Path | str] = ()
) -> list[StaleReference]:
    """Every file:line under `dirs` that still names the registry path `old`.

    Symlinked directories are not descended into; binary files (a NUL byte in the first
    8 KiB), files over 8 MiB, VCS directories and the registries themselves are skipped.
    """
    if not dirs:
        return []
    old = Path(old).expanduser().absolute()
    forms = _path_forms(old)
    # Not followed by another path-name character: `~/prefix-registry-old` is another path.
    pattern = re.compile("(?:" + "|".join(re.escape(f) for f in forms) + r")(?![\w-]|\.\w)")
    skip_real = {Path(p).expanduser().resolve() for p in skip} | {old.resolve()}
    found: list[StaleReference] = []
    for start in dirs:
        start_path = Path(start).expanduser()
        if start_path.is_file():
            found.extend(_scan_file(start_path, pattern))
            continue
        for directory, dirnames, filenames in os.walk(start_path):
            base = Path(directory)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in _SCAN_SKIP_DIRS and (base / d).resolve() not in skip_real
            )
            for name in sorted(filenames):
                found.extend(_scan_file(base / name, pattern))
    return found


def _scan_file(path: Path, pattern: re.Pattern[str]) -> list[StaleReference]:
    try:
        if not path.is_file() or path.stat().st_size > _SCAN_MAX_BYTES:
            return []
        data = path.read_bytes()
    except OSError:
        return []  # unreadable: not ours to judge
    if b"\0" in data[:8192]:
        return []
    text = data.decode("utf-8", errors="replace")
    return [
        StaleReference(str(path), lineno, line.strip()[:300])
        for lineno, line in enumerate(text.splitlines(), 1)
        if pattern.search(line)
    ]

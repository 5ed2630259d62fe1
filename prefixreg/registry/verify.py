"""`prefixreg verify`: an fsck of the registry. Reads everything, changes nothing (except
`repair_registry`, which only cuts torn journal tails and moves names through the journal).
Nothing is followed; every JSON record is read with the depth-capped reader (a record nested
100k deep is a bad record, never a crash).

Problems (verify exits 1): an object whose bytes do not hash to its name or that is not a
regular file (`corrupt`); a symlink anywhere below the root (`symlink`); an entry that is
not part of the layout (`unexpected`); a meta record, name, frame, measurement, snapshot or
journal line that does not parse or disagrees with what it describes (`bad_record`); a name
or snapshot record whose target is missing (`dangling`); a name that is not the `to` of its
last `names.log` line, or a journal ending in a torn line (`journal`); a writable object
(`bad_mode`); a file or directory other users can write to (`insecure_mode`).
Warnings: stray temp files, objects without meta (the debris of interrupted or in-flight
writes, which never hides or corrupts data), names that read as a sha reference, and (once)
the history records an adopted registry keeps in its own shapes (`legacy.json`, `legacy`).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import asdict, dataclass, field
from typing import Final, Literal

from prefixreg.core.errors import IntegrityError
from prefixreg.registry import layout
from prefixreg.registry.disk import LegacyRecordError
from prefixreg.registry.snapshots import check_snapshot_entry
from prefixreg.registry.store import Registry

Severity = Literal["problem", "warning"]
Tree = dict[str, list[tuple[str, str]]]  # directory (relative, "" = root) -> its entries
# Behind a symlinked directory: reported by the walk, neither present nor missing here.
_UNREACHABLE: Final = os.stat_result((0,) * 10)


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing `verify` found (`kind`: see the module docstring)."""

    kind: str
    path: str
    message: str
    severity: Severity = "problem"


@dataclass(slots=True)
class VerifyReport:
    """What `verify_registry` checked and found (and what `repair_registry` repaired)."""

    root: str
    objects: int = 0
    meta: int = 0
    names: int = 0
    measurements: int = 0
    legacy: int = 0
    findings: list[Finding] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (warnings such as stray temp files do not count)."""
        return not any(f.severity == "problem" for f in self.findings)

    def add(self, kind: str, path: str, message: str, severity: Severity = "problem") -> None:
        self.findings.append(Finding(kind, path, message, severity))

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        checked = {k: out.pop(k) for k in ("objects", "meta", "names", "measurements", "legacy")}
        return out | {"ok": self.ok, "checked": checked}


def verify_registry(reg: Registry) -> VerifyReport:
    """Check every object, meta record, name, journal, record and mode."""
    report = VerifyReport(root=str(reg.root))
    if not reg.exists:
        return report
    tree = _walk(reg, report)
    _verify_objects(reg, report, tree)
    _verify_meta(reg, report, tree)
    _verify_names(reg, report, tree)
    for entry, _kind in tree.get(layout.MEASUREMENTS, []):
        report.measurements += 1
        try:
            reg._records.load_measurement(entry)
        except LegacyRecordError:
            report.legacy += 1
        except IntegrityError as exc:
            report.add("bad_record", f"{layout.MEASUREMENTS}/{entry}", str(exc))
    for entry, kind in tree.get(layout.PROBES, []):
        if kind != "file":
            report.add("unexpected", f"{layout.PROBES}/{entry}", "not a probe receipt file")
    for entry, kind in tree.get(layout.FRAMES, []):
        # `Frames` sees only `<sha>.json` files: anything else here is reported, as in meta.
        rel = f"{layout.FRAMES}/{entry}"
        if kind != "file" or layout.frame_sha(rel) is None:
            report.add("unexpected", rel, "not a frame record")
    for rel, message in reg._frames.problems():
        report.add("bad_record", rel, message)
    for entry, kind in tree.get(layout.SNAPSHOTS, []):
        for what, message in check_snapshot_entry(reg, entry, kind):
            report.add(what, f"{layout.SNAPSHOTS}/{entry}", message)
    if report.legacy:  # once: history in an adopted registry's own shapes is never a problem
        why = f"{report.legacy} records of the adopted registry are kept in their own shapes"
        report.add("legacy", layout.LEGACY, why + " (read as legacy history)", "warning")
    return report


def repair_registry(reg: Registry) -> VerifyReport:
    """Cut torn journal tails, make every name agree with `names.log`, then verify again.
    Raises: UsageError (a mirror), LockTimeoutError."""
    reg.refuse_on_mirror("repair names")
    with reg.lock("mirror"):
        repaired = reg._disk.cut_tail(layout.MIRROR_LOG)
    repaired += reg._names.repair(reg._head)
    report = verify_registry(reg)
    report.repaired = repaired
    return report


def _group_is_private(st: os.stat_result) -> bool:
    """Is the entry's group its owner's private group (umask 002)? Then group write is safe."""
    try:
        group, owner = grp.getgrgid(st.st_gid), pwd.getpwuid(st.st_uid)
    except KeyError:
        return False
    return group.gr_name == owner.pw_name and owner.pw_gid == st.st_gid and not group.gr_mem


def unsafe_write_bits(st: os.stat_result) -> int:
    """The write bits `insecure_mode` flags on an entry: everyone's, and its group's unless
    the group is its owner's private one (0: none)."""
    mode = stat.S_IMODE(st.st_mode)
    bits = mode & stat.S_IWOTH
    if mode & stat.S_IWGRP and not _group_is_private(st):
        bits |= stat.S_IWGRP
    return bits


def _check_mode(reg: Registry, report: VerifyReport, rel: str, kind: str) -> None:
    try:
        st = reg.root.stat() if not rel else reg._disk.lstat(rel)
    except (OSError, IntegrityError):
        return
    if st is None:
        return
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        why = "writable by every user"
    elif mode & stat.S_IWGRP and not _group_is_private(st):
        why = f"writable by group {st.st_gid}"
    else:
        return
    what = "directory" if kind == "dir" else "file"
    fix = "other users could replace names or plant files: chmod go-w"
    report.add("insecure_mode", rel or ".", f"registry {what} is {why} (mode {mode:04o}); {fix}")


def _walk(reg: Registry, report: VerifyReport) -> Tree:
    """List the registry, following nothing; report symlinks, strays, modes, foreign entries."""
    tree: Tree = {}
    _check_mode(reg, report, "", "dir")
    try:
        extras = reg._disk.legacy()[1]  # an adopted registry's own root entries (`bin/`)
    except IntegrityError as exc:
        report.add("bad_record", layout.LEGACY, str(exc))
        extras = frozenset()
    at_root = {(d, "dir") for d in (*layout.EXPECTED_DIRS, *extras)}  # what the format allows
    at_root |= {(f, "file") for f in (*layout.ROOT_FILES, *extras)}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            entries = reg._disk.entries(rel_dir)
        except IntegrityError as exc:
            report.add("symlink", rel_dir, str(exc))
            continue
        kept = []
        for name, kind in entries:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if layout.is_temp_name(name):
                report.add("stray", rel, "temp file left by an interrupted write", "warning")
                continue
            if kind == "link":
                report.add("symlink", rel, "symlink in the registry; refused")
                continue
            _check_mode(reg, report, rel, kind)
            if not rel_dir and (name, kind) not in at_root:
                report.add("unexpected", rel, f"not part of a registry ({layout.FORMAT_DOC})")
                continue
            kept.append((name, kind))
            if kind == "dir":
                pending.append(rel)
        tree[rel_dir] = kept
    return tree


def _lstat(reg: Registry, rel: str) -> os.stat_result | None:
    try:
        return reg._disk.lstat(rel)
    except IntegrityError:
        return _UNREACHABLE


def _verify_objects(reg: Registry, report: VerifyReport, tree: Tree) -> None:
    for fan, fan_kind in tree.get(layout.OBJECTS, []):
        fan_rel = f"{layout.OBJECTS}/{fan}"
        if fan_kind != "dir" or len(fan) != 2 or fan_rel not in tree:
            report.add("unexpected", fan_rel, "not an object fan-out")
            continue
        for entry, kind in tree[fan_rel]:
            rel = f"{fan_rel}/{entry}"
            if (sha := layout.object_sha(rel)) is None:
                report.add("unexpected", rel, "not an object file")
                continue
            report.objects += 1
            if kind != "file":
                report.add("corrupt", rel, f"object is a {kind}, not a regular file; refused")
                continue
            try:
                reg.read_verified(sha)
            except IntegrityError as exc:
                report.add("corrupt", rel, str(exc))
                continue
            st = _lstat(reg, rel)
            if st is not None and st is not _UNREACHABLE and st.st_mode & 0o222:
                report.add("bad_mode", rel, "object is writable; objects must be read-only")
            if _lstat(reg, layout.meta_relpath(sha)) is None:
                why = "object has no meta record (interrupted add?); add it again"
                report.add("incomplete", rel, why, "warning")


def _verify_meta(reg: Registry, report: VerifyReport, tree: Tree) -> None:
    for entry, _kind in tree.get(layout.META, []):
        rel = f"{layout.META}/{entry}"
        if (sha := layout.meta_sha(rel)) is None:
            report.add("unexpected", rel, "not a meta record")
            continue
        report.meta += 1
        try:
            if reg._disk.is_legacy(rel):
                report.legacy += 1
                continue
            meta = reg.meta(sha)
        except IntegrityError as exc:
            report.add("bad_record", rel, str(exc))
            continue
        st = _lstat(reg, layout.object_relpath(sha))
        if st is None:
            report.add("orphan_meta", rel, "meta record without object")
        elif st is not _UNREACHABLE and stat.S_ISREG(st.st_mode) and st.st_size != meta.bytes:
            report.add("bad_record", rel, f"records {meta.bytes} bytes, object differs")


def _verify_names(reg: Registry, report: VerifyReport, tree: Tree) -> None:
    for entry, _kind in tree.get(layout.NAMES, []):
        rel = f"{layout.NAMES}/{entry}"
        if layout.NAME_RE.fullmatch(entry) is None or (
            len(entry) == 64 and layout.is_sha_like_name(entry)
        ):
            report.add("unexpected", rel, "not a valid name")
            continue
        report.names += 1
        if layout.is_sha_like_name(entry):
            why = (
                "name reads as a sha reference (8-64 hex digits) and shadows any object it "
                "abbreviates; new names like it are refused: move what uses it to another name"
            )
            report.add("sha_like_name", rel, why, "warning")
        try:
            sha = reg.read_name(entry)
        except IntegrityError as exc:
            report.add("bad_record", rel, str(exc))
            continue
        missing = sha is not None and _lstat(reg, layout.object_relpath(sha)) is None
        if missing and sha is not None and not reg._names.is_frame(sha):
            report.add("dangling", rel, f"points to missing {sha}")
    for journal in (layout.NAMES_LOG, layout.MIRROR_LOG):
        torn = reg._disk.torn_tail(journal) if (journal, "file") in tree.get("", []) else 0
        if torn:
            why = f"ends in a torn line ({torn} bytes of an interrupted write); run verify --repair"
            report.add("journal", journal, why)
    try:
        disagreements = reg._names.disagreements()
    except IntegrityError as exc:
        # A corrupt journal line, or a name that cannot be read (reported above as well).
        report.add("bad_record", layout.NAMES_LOG, f"cannot check names against it: {exc}")
        return
    for d in disagreements:
        report.add("journal", f"{layout.NAMES}/{d.name}", d.describe())

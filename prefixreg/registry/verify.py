"""`prefixreg verify`: an fsck of the registry. Reads everything, changes nothing.

Problems (verify exits 1): an object whose bytes do not hash to its name, a symlink
(anywhere: probes/ and the root included), an unexpected file (at the root: anything but
the files and directories of DESIGN §3 and `migrations.log`), a meta record or name that
does not parse or disagrees with its object, a name that points nowhere, a corrupt journal
line or measurement, a writable object, and a registry directory that other users can
write to (`insecure_mode`: they could swap names or plant files).
Warnings: stray temp files (in every registry directory and at the root) and objects
without meta: the debris of interrupted or in-flight writes, which never hides or corrupts
data (`add` again repairs an object without meta).
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from prefixreg.core.digest import is_full_sha, object_sha
from prefixreg.core.errors import IntegrityError
from prefixreg.registry import fsutil
from prefixreg.registry.store import NAME_RE, Registry

__all__ = ["Finding", "VerifyReport", "verify_registry"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing `verify` found.

    `kind` is one of: corrupt, symlink, unexpected, dangling, orphan_meta, bad_record,
    bad_mode, insecure_mode (problems) or stray, incomplete (warnings: debris of an interrupted or
    in-flight write that never hides or corrupts data).
    """

    kind: str
    path: str
    message: str
    severity: Literal["problem", "warning"] = "problem"

    def to_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "path": self.path,
            "message": self.message,
            "severity": self.severity,
        }


@dataclass(slots=True)
class VerifyReport:
    """What `Registry.verify` checked and found."""

    root: str
    objects: int = 0
    meta: int = 0
    names: int = 0
    measurements: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (warnings such as stray temp files do not count)."""
        return not any(f.severity == "problem" for f in self.findings)

    def to_dict(self) -> dict[str, object]:
        return {
            "root": self.root,
            "ok": self.ok,
            "checked": {
                "objects": self.objects,
                "meta": self.meta,
                "names": self.names,
                "measurements": self.measurements,
            },
            "findings": [f.to_dict() for f in self.findings],
        }


def verify_registry(reg: Registry) -> VerifyReport:
    """Check every object, meta record, name, measurement and journal line.

    Problems: an object whose bytes do not hash to its name, a symlink, an unexpected
    file, a meta record that does not parse or disagrees with its object, a name that
    points nowhere, a corrupt journal line or measurement. Warnings: stray temp files
    and objects without meta (both left by interrupted or in-flight writes).
    """
    report = VerifyReport(root=str(reg.root))
    if not reg.exists:
        return report
    _verify_directories(reg, report)
    _verify_objects(reg, report)
    _verify_meta(reg, report)
    _verify_names(reg, report)
    _verify_measurements(reg, report)
    _verify_probes(reg, report)
    _verify_root(reg, report)
    return report


# The registry's own directories: a symlink in their place would redirect reads and writes.
_SUBDIRS = ("objects", "meta", "names", "measurements", "probes", "snapshots", ".locks")
# The only files a registry root holds (DESIGN §3, plus `migrate`'s journal).
_ROOT_FILES = frozenset({"REGISTRY.json", "README.md", "names.log", "mirror.log", "migrations.log"})


def _group_is_private(st: os.stat_result) -> bool:
    """True when the directory's group is its owner's private group (a user-private-group
    system with umask 002): group write then grants nobody else anything."""
    try:
        group = grp.getgrgid(st.st_gid)
        owner = pwd.getpwuid(st.st_uid)
    except KeyError:
        return False
    return group.gr_name == owner.pw_name and owner.pw_gid == st.st_gid and not group.gr_mem


def _insecure(st: os.stat_result) -> str | None:
    """Why a directory with this mode lets other users write into it, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        return "writable by every user"
    if mode & stat.S_IWGRP and not _group_is_private(st):
        return f"writable by group {st.st_gid}"
    return None


def _verify_directories(reg: Registry, report: VerifyReport) -> None:
    """Top-level symlinks, and directories other users may write to."""
    for sub in _SUBDIRS:
        path = reg.root / sub
        if path.is_symlink():
            report.findings.append(Finding("symlink", sub, "symlinked directory; refused"))
    for directory, dirnames, _files in os.walk(reg.root):  # never follows symlinks
        try:
            # The root may be a symlink (a user's choice): judge the directory it names.
            st = Path(directory).stat() if directory == str(reg.root) else os.lstat(directory)
        except OSError:
            continue
        why = _insecure(st)
        if why is not None:
            rel = os.path.relpath(directory, reg.root)
            report.findings.append(
                Finding(
                    "insecure_mode",
                    rel,
                    f"registry directory is {why} (mode {stat.S_IMODE(st.st_mode):04o}); "
                    "other users could replace names or plant files: chmod go-w",
                )
            )
        dirnames[:] = [d for d in dirnames if not fsutil.is_temp_name(d)]


def _scan(
    reg: Registry,
    directory: Path,
    report: VerifyReport,
    *,
    skip_symlinks: frozenset[str] = frozenset(),
) -> Iterator[Path]:
    """Entries of `directory`, reporting strays and symlinks on the way.

    The root may itself be a symlink (a user's choice); any other symlinked directory is
    reported once, by `_verify_directories`, and not scanned.
    """
    if (directory != reg.root and directory.is_symlink()) or not directory.is_dir():
        return
    for entry in sorted(directory.iterdir()):
        rel = str(entry.relative_to(reg.root))
        if fsutil.is_temp_name(entry.name):
            report.findings.append(
                Finding("stray", rel, "temp file left by an interrupted write", "warning")
            )
        elif entry.is_symlink():
            if entry.name not in skip_symlinks:
                report.findings.append(Finding("symlink", rel, "symlink in the registry; refused"))
        else:
            yield entry


def _verify_objects(reg: Registry, report: VerifyReport) -> None:
    for fan in _scan(reg, reg.root / "objects", report):
        if not fan.is_dir() or re.fullmatch(r"[0-9a-f]{2}", fan.name) is None:
            report.findings.append(
                Finding("unexpected", str(fan.relative_to(reg.root)), "not an object fan-out")
            )
            continue
        for entry in _scan(reg, fan, report):
            rel = str(entry.relative_to(reg.root))
            sha = object_sha(fan.name, entry.name)
            if sha is None:
                report.findings.append(Finding("unexpected", rel, "not an object file"))
                continue
            report.objects += 1
            try:
                reg.read_verified(sha)
            except IntegrityError as exc:
                report.findings.append(Finding("corrupt", rel, str(exc)))
                continue
            if entry.stat().st_mode & 0o222:
                report.findings.append(
                    Finding("bad_mode", rel, "object is writable; objects must be read-only")
                )
            if not reg.meta_path(sha).exists():
                report.findings.append(
                    Finding(
                        "incomplete",
                        rel,
                        "object has no meta record (interrupted add?); add it again",
                        "warning",
                    )
                )


def _verify_meta(reg: Registry, report: VerifyReport) -> None:
    for entry in _scan(reg, reg.root / "meta", report):
        rel = str(entry.relative_to(reg.root))
        sha = entry.name.removesuffix(".json")
        if not (entry.name.endswith(".json") and is_full_sha(sha)):
            report.findings.append(Finding("unexpected", rel, "not a meta record"))
            continue
        report.meta += 1
        try:
            meta = reg.meta(sha)
        except IntegrityError as exc:
            report.findings.append(Finding("bad_record", rel, str(exc)))
            continue
        obj = reg.object_path(sha)
        if not obj.exists():
            report.findings.append(Finding("orphan_meta", rel, "meta record without object"))
        elif not obj.is_symlink() and obj.stat().st_size != meta.bytes:
            report.findings.append(
                Finding("bad_record", rel, f"records {meta.bytes} bytes, object differs")
            )


def _verify_names(reg: Registry, report: VerifyReport) -> None:
    for entry in _scan(reg, reg.root / "names", report):
        rel = str(entry.relative_to(reg.root))
        if NAME_RE.fullmatch(entry.name) is None or is_full_sha(entry.name.lower()):
            report.findings.append(Finding("unexpected", rel, "not a valid name"))
            continue
        report.names += 1
        try:
            sha = reg.read_name(entry.name)
        except IntegrityError as exc:
            report.findings.append(Finding("bad_record", rel, str(exc)))
            continue
        if sha is not None and not reg.object_path(sha).exists():
            report.findings.append(Finding("dangling", rel, f"points to missing {sha}"))
    try:
        reg.name_log()
    except IntegrityError as exc:
        report.findings.append(Finding("bad_record", "names.log", str(exc)))


def _verify_probes(reg: Registry, report: VerifyReport) -> None:
    """Probe receipts: strays and symlinks (via `_scan`), and anything not a regular file."""
    for entry in _scan(reg, reg.root / "probes", report):
        if not entry.is_file():
            rel = str(entry.relative_to(reg.root))
            report.findings.append(Finding("unexpected", rel, "not a probe receipt file"))


def _verify_root(reg: Registry, report: VerifyReport) -> None:
    """The root itself: strays, symlinks and anything that is not part of the format."""
    for entry in _scan_root(reg, report):
        name = entry.name
        ok = entry.is_dir() if name in _SUBDIRS else name in _ROOT_FILES and entry.is_file()
        if not ok:
            report.findings.append(
                Finding("unexpected", name, "not part of a registry (DESIGN §3 layout)")
            )


def _scan_root(reg: Registry, report: VerifyReport) -> Iterator[Path]:
    # A symlinked subdirectory is already reported by _verify_directories; report it once.
    yield from _scan(reg, reg.root, report, skip_symlinks=frozenset(_SUBDIRS))


def _verify_measurements(reg: Registry, report: VerifyReport) -> None:
    for entry in _scan(reg, reg.root / "measurements", report):
        rel = str(entry.relative_to(reg.root))
        report.measurements += 1
        try:
            reg._load_measurement(entry)
        except IntegrityError as exc:
            report.findings.append(Finding("bad_record", rel, str(exc)))

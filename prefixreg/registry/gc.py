"""`prefixreg gc`: remove the debris of interrupted writes and, only if asked, old unnamed prefixes.

What it removes, all under the registry's exclusive lock (the one name moves take):

- stray temp files (`.<name>.<random>.tmp`, left by a killed writer) older than the grace
  period;
- with `prune_unnamed` only: objects that no name points to, whose mtime (refreshed by
  every re-add) is older than the grace period and that no measurement newer than the
  grace period refers to, together with their meta records;
- with `prune_snapshots` only: snapshot records whose prefix object is gone, older than
  the grace period (the snapshot files, in the server's directory, are never touched).

Nothing younger than `MIN_AGE_S` (60 s) is touched whatever the grace, even `--grace 0`:
a younger temp file may be a write in flight, a younger object one an `add` is still
completing (its meta record not yet written).

Invariants:
- Nothing is followed: the registry is listed with the store's no-follow walk, and a
  symlink anywhere below the root (a symlinked `objects/` or `meta/` included) or an object
  that is not a regular file makes gc refuse to run (`IntegrityError`, exit 3) before
  anything is removed, so no file outside the registry is ever touched.
- Nothing a name or a snapshot record points to, nor the `to` of any name's last journal
  line (an interrupted move `verify --repair` may complete), is ever removed; names,
  journals, measurements and probe receipts are never removed at all (history stays), nor
  a snapshot record unless `prune_snapshots` is asked for.
- A probe receipt keeps the objects its calls list, like a name (and, while a receipt does
  not parse, every object marked a probe slice: `probeslices`).
- Removal order is the reverse of the write order (meta, then object), so an interrupted
  gc leaves at worst an object without meta or a stray temp file (both `verify` warnings),
  never a meta record or name whose object is missing.
- An object is first *claimed* (renamed to a temp name) and its mtime re-read: if an `add`
  re-used it since gc looked, the mtime moved (by at least `MIN_AGE_S`, far beyond clock
  granularity) and the object and its meta are put back. An `add` that comes after the
  claim finds the object gone and publishes it again.
- A dry run takes the same lock and decides the same way, and changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject
from prefixreg.registry import fsutil, layout
from prefixreg.registry.frames import frame_parts
from prefixreg.registry.probeslices import receipt_refs
from prefixreg.registry.snapshots import prune_snapshot_records, snapshot_prefix_shas
from prefixreg.registry.store import Registry

__all__ = ["DEFAULT_GRACE", "MIN_AGE_S", "GcItem", "GcReport", "collect_garbage", "parse_grace"]

DEFAULT_GRACE: Final = "14d"
MIN_AGE_S: Final = 60.0
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_GRACE_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_STAMP_RE = re.compile(r"-(\d{8}T\d{6})\.(\d{6})Z\.json$")


def parse_grace(text: str) -> float:
    """Parse a grace period: `14d`, `12h`, `30m`, `45s`, `2w`, or `0`; return seconds.

    A bare number other than 0 is refused: `14` could mean days or seconds.

    Raises:
        UsageError: anything else.
    """
    match = _GRACE_RE.fullmatch(text.strip())
    if match is None:
        raise UsageError(f"invalid grace period {text!r}: use e.g. 14d, 12h, 30m, 45s or 0")
    number, unit = float(match.group(1)), match.group(2)
    if not unit and number != 0:
        raise UsageError(f"grace period {text!r} needs a unit: s, m, h, d or w")
    return number * _UNITS.get(unit, 1)


@dataclass(frozen=True, slots=True)
class GcItem:
    """One file gc removed (or, in a dry run, would remove)."""

    kind: Literal["stray", "object", "meta", "snapshot"]
    path: str  # relative to the registry root
    age_s: float

    def to_dict(self) -> JSONObject:
        return {"kind": self.kind, "path": self.path, "age_s": round(self.age_s, 3)}


@dataclass(slots=True)
class GcReport:
    """What one gc run removed, and the unnamed objects it kept (with why)."""

    root: str
    dry_run: bool
    grace_s: float
    prune_unnamed: bool
    prune_snapshots: bool = False
    removed: list[GcItem] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # sha -> reason

    def to_dict(self) -> JSONObject:
        return {
            "root": self.root,
            "dry_run": self.dry_run,
            "grace_s": self.grace_s,
            "prune_unnamed": self.prune_unnamed,
            "prune_snapshots": self.prune_snapshots,
            "removed": [item.to_dict() for item in self.removed],
            "kept": dict(self.kept),
        }


def collect_garbage(
    reg: Registry,
    *,
    grace_s: float,
    prune_unnamed: bool = False,
    prune_snapshots: bool = False,
    dry_run: bool = False,
    now: float | None = None,
    min_age_s: float = MIN_AGE_S,
) -> GcReport:
    """Remove stray temp files and (with `prune_unnamed`) old unnamed objects.

    Args:
        grace_s: only files older than this many seconds are touched.
        prune_unnamed: also remove unnamed, unreferenced objects older than the grace
            (an object a snapshot record points to is kept, as a named one is).
        prune_snapshots: also remove snapshot records older than the grace whose prefix
            object is gone.
        dry_run: decide, report, change nothing.
        now: the clock (tests); defaults to the current time.
        min_age_s: the age below which nothing is touched whatever the grace (tests lower
            it to exercise pruning in seconds; it must exceed the longest `add`).

    Raises:
        UsageError: a negative grace, or pruning a mirror (prune at the origin instead).
        IntegrityError: a symlink below the root or an object that is not a regular file
            (nothing is removed).
        LockTimeoutError: another process holds the registry lock.
    """
    if grace_s < 0:
        raise UsageError("the grace period cannot be negative")
    report = GcReport(
        root=str(reg.root),
        dry_run=dry_run,
        grace_s=grace_s,
        prune_unnamed=prune_unnamed,
        prune_snapshots=prune_snapshots,
    )
    if not reg.exists:
        return report  # never create a registry just to collect nothing
    if (prune_unnamed or prune_snapshots) and reg.role == "mirror":
        raise UsageError(
            "refusing to prune objects on a mirror: the next mirror run decides what it holds",
            hint="run gc --prune-unnamed on the origin",
        )
    with reg.lock():
        moment = time.time() if now is None else now
        cutoff = moment - max(grace_s, min_age_s)
        reg.refuse_links()
        if prune_unnamed:
            list(reg.iter_shas(regular_only=True))  # a non-file object: refuse up front
        _collect_strays(reg, report, cutoff=cutoff, now=moment)
        if prune_unnamed:
            _prune_unnamed(reg, report, cutoff=cutoff, now=moment)
        if prune_snapshots:
            for rel, mtime in prune_snapshot_records(reg, cutoff=cutoff, dry_run=dry_run):
                report.removed.append(GcItem("snapshot", rel, moment - mtime))
    return report


def _collect_strays(reg: Registry, report: GcReport, *, cutoff: float, now: float) -> None:
    for rel, kind in reg.walk():
        if kind != "file" or rel.startswith(f"{layout.LOCKS}/"):
            continue
        if not layout.is_temp_name(rel.rsplit("/", 1)[-1]):
            continue
        st = reg.lstat(rel)
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_mtime > cutoff:
            continue  # gone (its writer finished), or young: may be a write in flight
        if not report.dry_run:
            try:
                reg.path(rel).unlink()
            except FileNotFoundError:
                continue
        report.removed.append(GcItem("stray", rel, now - st.st_mtime))


def _recent_measurements(reg: Registry, cutoff: float) -> set[str]:
    """Shas referred to by a measurement newer than `cutoff` (by file name time or mtime)."""
    recent: set[str] = set()
    for name, _kind in reg.entries(layout.MEASUREMENTS):
        sha = layout.measurement_sha(name)
        if sha is None or layout.is_temp_name(name):
            continue
        newest = 0.0
        with contextlib.suppress(OSError):
            st = reg.lstat(f"{layout.MEASUREMENTS}/{name}")
            newest = st.st_mtime if st is not None else 0.0
        match = _STAMP_RE.search(name)
        if match is not None:
            with contextlib.suppress(ValueError, OverflowError):
                stamp = time.strptime(match.group(1), "%Y%m%dT%H%M%S")
                newest = max(newest, _timegm(stamp) + int(match.group(2)) / 1e6)
        if newest > cutoff:
            recent.add(sha)
    return recent


def _timegm(parts: time.struct_time) -> float:
    import calendar

    return float(calendar.timegm(parts))


def _prune_unnamed(reg: Registry, report: GcReport, *, cutoff: float, now: float) -> None:
    # Names only move under the lock we hold, so this snapshot stays true for the run.
    # The last journalled `to` of each name counts as named too: an interrupted move that
    # `verify --repair` will complete must still find its object.
    last_to = {move.name: move.to_sha for move in reg.name_log()}
    named = (
        set(reg.names().values()) | set(last_to.values()) | frame_parts(reg)
    )  # a frame keeps its parts
    recent = _recent_measurements(reg, cutoff)
    # A receipt keeps its slices like a name; one that does not parse keeps every slice.
    receipts = reg.probe_receipts()
    by_receipt, receipt_unread = receipt_refs(raw for _path, raw in receipts)
    # A receipt that could not even be read (probe_receipts skips it) keeps every slice too.
    listed = [
        n
        for n, kind in reg.entries(layout.PROBES)
        if kind == "file" and n.endswith(".json") and not layout.is_temp_name(n)
    ]
    receipt_unread = receipt_unread or len(listed) > len(receipts)
    snapped = snapshot_prefix_shas(reg)
    for sha in list(reg.iter_shas()):
        if sha in named:
            continue
        if sha in snapped:
            report.kept[sha] = "a snapshot record points to it"
            continue
        if sha in by_receipt or (receipt_unread and reg.is_probe_slice(sha)):
            report.kept[sha] = "a probe receipt refers to it"
            continue
        if sha in recent:
            report.kept[sha] = "a measurement newer than the grace period refers to it"
            continue
        obj = reg.object_path(sha)
        st = reg.lstat(layout.object_relpath(sha))
        if st is None:
            continue
        if not stat.S_ISREG(st.st_mode):
            report.kept[sha] = "not a regular file (verify reports it); left alone"
            continue
        if st.st_mtime > cutoff:
            report.kept[sha] = "used within the grace period"
            continue
        rel_obj = str(obj.relative_to(reg.root))
        meta = reg.meta_path(sha)
        meta_st = reg.lstat(layout.meta_relpath(sha))
        has_meta = meta_st is not None and stat.S_ISREG(meta_st.st_mode)
        if report.dry_run:
            report.removed.append(GcItem("object", rel_obj, now - st.st_mtime))
            if has_meta:
                rel_meta = str(meta.relative_to(reg.root))
                report.removed.append(GcItem("meta", rel_meta, now - st.st_mtime))
            continue
        _remove_object(reg, report, sha, seen_mtime_ns=st.st_mtime_ns, now=now)


def _claim(path: Path) -> Path | None:
    """Rename `path` to a temp name in its directory (so an interrupted gc leaves a stray,
    which verify reports as a warning); None if it is already gone."""
    claimed = path.with_name(f".{path.name}.gc{secrets.token_hex(4)}{fsutil.TMP_SUFFIX}")
    try:
        path.rename(claimed)
    except FileNotFoundError:
        return None
    return claimed


def _restore(claimed: Path, path: Path) -> None:
    """Put a claimed file back without overwriting one a concurrent writer published."""
    try:
        os.link(claimed, path)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
    claimed.unlink()


def _remove_object(
    reg: Registry, report: GcReport, sha: str, *, seen_mtime_ns: int, now: float
) -> None:
    obj, meta = reg.object_path(sha), reg.meta_path(sha)
    # Meta first (reverse write order): a crash from here on leaves an object without meta
    # (a warning that `add` repairs), never a meta record without its object.
    meta_st = reg.lstat(layout.meta_relpath(sha))
    has_meta = meta_st is not None and stat.S_ISREG(meta_st.st_mode)
    meta_claim = _claim(meta) if has_meta else None
    obj_claim = _claim(obj)
    if obj_claim is None:
        if meta_claim is not None:
            _restore(meta_claim, meta)
        return
    claimed_st = obj_claim.lstat()
    age = now - claimed_st.st_mtime
    if claimed_st.st_mtime_ns != seen_mtime_ns:
        # A concurrent add re-used the object between our look and the claim: keep it.
        _restore(obj_claim, obj)
        if meta_claim is not None:
            _restore(meta_claim, meta)
        fsutil.fsync_dir(obj.parent)
        report.kept[sha] = "re-added while gc ran"
        return
    obj_claim.unlink()
    fsutil.fsync_dir(obj.parent)
    report.removed.append(GcItem("object", str(obj.relative_to(reg.root)), age))
    if meta_claim is not None:
        meta_claim.unlink()
        fsutil.fsync_dir(meta.parent)
        report.removed.append(GcItem("meta", str(meta.relative_to(reg.root)), age))

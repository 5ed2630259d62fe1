"""`prefixreg gc`: remove the debris of interrupted writes and, only if asked, old unnamed prefixes.

Under the registry lock (the one name moves take) it removes stray temp files older than the
grace; with `prune_unnamed`, frame records, then objects (and meta), nothing refers to whose
mtime (every re-add or re-registration refreshes it) is older than the grace; with
`prune_snapshots`, snapshot records whose head is gone (never the snapshot files). Nothing
younger than `MIN_AGE_S` is touched, whatever the grace: it may be a write in flight.

Invariants:
- Nothing is followed: a symlink below the root, or an object that is not a regular file,
  makes gc refuse (`IntegrityError`) before anything is removed.
- Never removed: what a name, a kept frame or a snapshot record points to, the `to` of a
  name's last journal line (an interrupted move), what a probe receipt lists (every probe
  slice while a receipt cannot be read), anything a measurement newer than the grace names
  (by its file name or as its frame; every frame on its prefix while it cannot be read);
  names, journals, measurements and receipts at all. Each unnamed object or frame kept is
  listed in `kept` with the reason. Records are read with the depth-capped JSON reader: a
  hostile record fails closed.
- Removal is the reverse of the write order (a frame record before the parts it held; meta,
  then object): a crash never leaves a frame whose part is gone. An object or frame record
  is first claimed (renamed to a temp name) and put back, with its meta, if an `add` or
  `add_frame` re-used it meanwhile (its mtime moved). A dry run takes the same lock,
  decides the same way, changes nothing.
"""

from __future__ import annotations

import calendar
import contextlib
import math
import os
import re
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import IntegrityError, UsageError
from prefixreg.core.jsonio import JSONObject
from prefixreg.registry import fsutil, layout
from prefixreg.registry.snapshots import prune_snapshot_records, record_entries
from prefixreg.registry.store import Registry

MIN_AGE_S: Final = 60.0
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_GRACE_RE: Final = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")
_STAMP_RE: Final = re.compile(r"-(\d{8}T\d{6})\.(\d{6})Z\.json$")


def parse_grace(text: str) -> float:
    """Seconds in a grace period (`14d`, `12h`, `30m`, `45s`, `2w`, `0`), else `UsageError`:
    a bare number other than 0 could mean days or seconds."""
    given: object = text
    match = _GRACE_RE.fullmatch(given.strip()) if isinstance(given, str) else None
    if match is None:
        raise UsageError(f"invalid grace period {text!r}: use e.g. 14d, 12h, 30m, 45s or 0")
    number, unit = float(match.group(1)), match.group(2)
    if not unit and number != 0:
        raise UsageError(f"grace period {text!r} needs a unit: s, m, h, d or w")
    return number * _UNITS.get(unit, 1)


@dataclass(frozen=True, slots=True)
class GcItem:
    """One file gc removed (or, in a dry run, would remove)."""

    kind: Literal["stray", "frame", "object", "meta", "snapshot"]
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
        return asdict(self) | {"removed": [item.to_dict() for item in self.removed]}


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
    """See the module docstring; `min_age_s`: nothing younger is touched (tests lower it; it
    must exceed the longest `add`). Raises: UsageError (a grace not a finite number >= 0, or
    pruning a mirror); IntegrityError (a symlink below the root or an object not a regular
    file: nothing is removed); LockTimeoutError."""
    given: object = grace_s
    if not isinstance(given, int | float) or isinstance(given, bool) or not math.isfinite(given):
        raise UsageError(f"the grace period must be a finite number, not {grace_s!r}")
    if grace_s < 0:
        raise UsageError("the grace period cannot be negative")
    report = GcReport(str(reg.root), dry_run, grace_s, prune_unnamed, prune_snapshots)
    if not reg.exists:
        return report  # never create a registry just to collect nothing
    if (prune_unnamed or prune_snapshots) and reg.role == "mirror":
        why = "refusing to prune objects on a mirror: the next mirror run decides what it holds"
        raise UsageError(why, hint="run gc --prune-unnamed on the origin")
    with reg.lock():
        moment = time.time() if now is None else now
        cutoff = moment - max(grace_s, min_age_s)
        reg._disk.refuse_links()
        if prune_unnamed:
            list(reg._objects.shas(regular_only=True))  # a non-file object: refuse up front
        for rel, kind in reg._disk.walk():
            stray = kind == "file" and layout.is_temp_name(rel.rsplit("/", 1)[-1])
            if stray and not rel.startswith(f"{layout.LOCKS}/"):
                mtime = reg._disk.remove_old(rel, cutoff, dry_run=dry_run)
                if mtime is not None:
                    report.removed.append(GcItem("stray", rel, moment - mtime))
        if prune_unnamed:
            _prune_unnamed(reg, report, cutoff=cutoff, now=moment)
        if prune_snapshots:
            for rel, mtime in prune_snapshot_records(reg, cutoff=cutoff, dry_run=dry_run):
                report.removed.append(GcItem("snapshot", rel, moment - mtime))
    return report


def _recent_measurements(reg: Registry, cutoff: float) -> tuple[set[str], set[str]]:
    """(shas a measurement newer than `cutoff` (by file name time or mtime) names, by file
    name or as its frame; the file-name shas of those that could not be read, whose frame is
    unknown: every frame on that system prefix is kept)."""
    recent: set[str] = set()
    unread: set[str] = set()
    for name, _kind in reg._disk.entries(layout.MEASUREMENTS):
        sha = layout.measurement_sha(name)
        if sha is None or layout.is_temp_name(name):
            continue
        st = reg._disk.lstat(f"{layout.MEASUREMENTS}/{name}")
        newest = st.st_mtime if st is not None else 0.0
        if (match := _STAMP_RE.search(name)) is not None:
            with contextlib.suppress(ValueError, OverflowError):
                stamp = calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%S"))
                newest = max(newest, stamp + int(match.group(2)) / 1e6)
        if newest > cutoff:
            recent.add(sha)
            try:
                frame = reg._records.load_measurement(name).outcome.frame
            except (OSError, IntegrityError):  # fail closed: keep what it may name
                unread.add(sha)
                continue
            recent.update([frame] if frame is not None else [])
    return recent, unread


def _prune_unnamed(reg: Registry, report: GcReport, *, cutoff: float, now: float) -> None:
    # Names only move under the lock we hold, so this view stays true for the run. The last
    # journalled `to` of each name counts as named too (an interrupted move). Frame records
    # go first, then objects, so a frame never outlives a part: a frame kept (for any reason)
    # keeps its parts, a frame pruned (or, in a dry run, that would be) no longer does.
    last_to = {move.name: move.to_sha for move in reg.name_log()}
    named = set(reg.names().values()) | set(last_to.values())
    reg._frames.parts()  # a record that does not parse: refuse before anything is removed
    frames = {sha: p for sha, p in reg._frames.checked().items() if not isinstance(p, str)}
    recent, unread = _recent_measurements(reg, cutoff)
    by_receipt, receipt_unread = reg._records.receipt_refs()
    snapped = {sha for _name, sha in record_entries(reg)}  # by file name, parsed or not
    gone: set[str] = set()
    for sha, (system, *_parts) in sorted(frames.items()):
        if sha in named:
            continue
        if sha in snapped:
            report.kept[sha] = "a snapshot record points to it"
        elif sha in by_receipt:
            report.kept[sha] = "a probe receipt refers to it"
        elif sha in recent or system in unread:
            report.kept[sha] = "a measurement newer than the grace period refers to it"
        elif _prune_one(reg, report, sha, cutoff=cutoff, now=now, frame=True):
            gone.add(sha)
    held = {part for sha, parts in frames.items() if sha not in gone for part in parts if part}
    for sha in [sha for sha in reg._objects.shas() if sha not in named]:
        if sha in held:
            report.kept[sha] = "a frame kept holds it (its system prompt, tools or messages)"
        elif sha in snapped:
            report.kept[sha] = "a snapshot record points to it"
        elif sha in by_receipt or (receipt_unread and reg.is_probe_slice(sha)):
            report.kept[sha] = "a probe receipt refers to it"
        elif sha in recent:
            report.kept[sha] = "a measurement newer than the grace period refers to it"
        else:
            _prune_one(reg, report, sha, cutoff=cutoff, now=now)


def _prune_one(
    reg: Registry, report: GcReport, sha: str, *, cutoff: float, now: float, frame: bool = False
) -> bool:
    """Remove object `sha` and its meta (`frame`: frame record `sha`) if old enough; whether
    it is gone now (in a dry run: would be)."""
    obj_rel = layout.frame_relpath(sha) if frame else layout.object_relpath(sha)
    meta_rel = layout.meta_relpath(sha)
    st = reg._disk.lstat(obj_rel)
    if st is None:
        return True
    if not stat.S_ISREG(st.st_mode):
        report.kept[sha] = "not a regular file (verify reports it); left alone"
        return False
    if st.st_mtime > cutoff:
        report.kept[sha] = "used within the grace period"
        return False
    meta_st = None if frame else reg._disk.lstat(meta_rel)
    has_meta = meta_st is not None and stat.S_ISREG(meta_st.st_mode)
    if not report.dry_run:
        obj, meta = reg._disk.path(obj_rel), reg._disk.path(meta_rel)
        # Meta first (reverse write order): a crash from here on leaves an object without meta
        # (a warning that `add` repairs), never a meta record without its object.
        meta_claim = _claim(meta) if has_meta else None
        obj_claim = _claim(obj)
        if obj_claim is None or obj_claim.lstat().st_mtime_ns != st.st_mtime_ns:
            # Gone, or a concurrent add re-used it between our look and the claim: keep it.
            for claim, path in ((obj_claim, obj), (meta_claim, meta)):
                if claim is not None:
                    with contextlib.suppress(FileExistsError):  # never replaces a writer's new file
                        os.link(claim, path)
                    claim.unlink()
            if obj_claim is not None:
                fsutil.fsync_dir(obj.parent)
                report.kept[sha] = "re-added while gc ran"
                return False
            return True
        for claim in (obj_claim, meta_claim):
            if claim is not None:
                claim.unlink()
                fsutil.fsync_dir(claim.parent)
        has_meta = meta_claim is not None
    report.removed.append(GcItem("frame" if frame else "object", obj_rel, now - st.st_mtime))
    if has_meta:
        report.removed.append(GcItem("meta", meta_rel, now - st.st_mtime))
    return True


def _claim(path: Path) -> Path | None:
    """Rename `path` to a temp name (an interrupted gc leaves a stray); None if it is gone."""
    claimed = path.with_name(f".{path.name}.gc{secrets.token_hex(4)}{layout.TMP_SUFFIX}")
    try:
        path.rename(claimed)
    except FileNotFoundError:
        return None
    return claimed

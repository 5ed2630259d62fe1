"""`prefixreg verify`: an fsck of the registry. Reads everything, changes nothing (except
`repair_registry`, which only cuts torn journal tails and moves names through the journal).
Nothing is followed; every JSON record is read with the depth-capped reader (a record nested
100k deep is a bad record, never a crash). Every object is re-hashed. At scale (#33): each
directory is listed once with its entries' lstats, except the objects and meta records,
which are read through one no-follow descriptor of their directory (`dirfd`) and checked
(mode included) from that descriptor's fstat; what is present is known from the listing.

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

import contextlib
import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from prefixreg.core.errors import IntegrityError, RegistryLocationError
from prefixreg.core.jsonio import loads_flat
from prefixreg.core.records import Meta
from prefixreg.registry import layout
from prefixreg.registry.disk import LegacyRecordError
from prefixreg.registry.modes import insecure_why
from prefixreg.registry.snapshots import check_snapshot_entry
from prefixreg.registry.store import Registry

if TYPE_CHECKING:
    from prefixreg.registry.dirfd import ReadResult

Severity = Literal["problem", "warning"]
Tree = dict[str, list[tuple[str, str]]]  # directory (relative, "" = root) -> its entries
Seen = dict[str, dict[str, str]]  # directory -> every entry's kind, temp files and links too
Sizes = dict[str, int | None]  # object sha -> its size (None: not a regular file)
Later = dict[str, set[str]]  # directory -> the regular files a later pass reads
Read = tuple[bytes, os.stat_result]  # a file's bytes and the fstat of what was read


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

    @property
    def outcome(self) -> Literal["ok", "problems"]:
        """What `verify` found, for the exit-code table: `problems` exits 1."""
        return "ok" if self.ok else "problems"

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
    tree, seen, later = _walk(reg, report)
    sizes = _verify_objects(reg, report, tree, seen, later)
    _verify_meta(reg, report, tree, sizes, seen, later)
    _verify_names(reg, report, tree, seen)
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


def check_registry(reg: Registry, *, repair: bool = False) -> VerifyReport:
    """A verify (`repair`: a repair) of a registry that must be there (RegistryLocationError)."""
    if not reg.exists:  # before a repair too: it would create one
        why = "does not exist" if not reg.root.exists() else f"has no {layout.MARKER}"
        raise RegistryLocationError(f"{reg.root}: no registry to verify (the path {why})")
    return repair_registry(reg) if repair else verify_registry(reg)


def _check_mode(report: VerifyReport, rel: str, kind: str, st: os.stat_result) -> None:
    if (why := insecure_why(st)) is None:
        return
    what = "directory" if kind == "dir" else "file"
    fix = "other users could replace names or plant files: chmod go-w"
    mode = stat.S_IMODE(st.st_mode)
    report.add("insecure_mode", rel or ".", f"registry {what} is {why} (mode {mode:04o}); {fix}")


def _read_later(rel_dir: str, later: Later) -> Callable[[str, str], bool]:
    """Which entries of `rel_dir` a later pass reads, and checks the mode of from the
    descriptor's fstat (objects and meta records): the walk takes no lstat of those, and
    notes them in `later[rel_dir]` (the passes then need no second match of each name)."""
    if rel_dir == layout.META:
        names = later.setdefault(rel_dir, set())

        def meta(name: str, kind: str) -> bool:
            if kind == "file" and layout.META_FILE.fullmatch(name) is not None:
                names.add(name)
                return True
            return False

        return meta
    if rel_dir.startswith(f"{layout.OBJECTS}/") and rel_dir.count("/") == 1:
        names, fan = later.setdefault(rel_dir, set()), rel_dir[len(layout.OBJECTS) + 1 :]

        def obj(name: str, kind: str) -> bool:
            if kind == "file" and (m := layout.OBJECT_FILE.fullmatch(name)) and m[2] == fan:
                names.add(name)
                return True
            return False

        return obj
    return lambda name, kind: False


def _walk(reg: Registry, report: VerifyReport) -> tuple[Tree, Seen, Later]:
    """List the registry, following nothing; report symlinks, strays, modes, foreign entries.
    Also every entry of every directory listed (temp files and links too), for the checks
    of what is present."""
    tree: Tree = {}
    seen: Seen = {}
    later: Later = {}
    with contextlib.suppress(OSError):
        _check_mode(report, "", "dir", reg.root.stat())
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
            entries = reg._disk.scan(rel_dir, _read_later(rel_dir, later))
        except IntegrityError as exc:
            report.add("symlink", rel_dir, str(exc))
            continue
        seen[rel_dir] = {name: kind for name, kind, _st in entries}
        kept = []
        for name, kind, st in entries:
            if st is None:  # an object or meta record a later pass reads (and checks)
                kept.append((name, kind))
                continue
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if layout.is_temp_name(name):
                report.add("stray", rel, "temp file left by an interrupted write", "warning")
                continue
            if kind == "link":
                report.add("symlink", rel, "symlink in the registry; refused")
                continue
            if st is not None:
                _check_mode(report, rel, kind, st)
            if not rel_dir and (name, kind) not in at_root:
                report.add("unexpected", rel, f"not part of a registry ({layout.FORMAT_DOC})")
                continue
            kept.append((name, kind))
            if kind == "dir":
                pending.append(rel)
        tree[rel_dir] = kept
    return tree, seen, later


def _present(seen: Seen, rel: str) -> bool | None:
    """Was `rel` there when the walk listed its directory? None: its directory could not be
    reached without following a link (or is not a directory), so neither."""
    parent, _, name = rel.rpartition("/")
    if parent in seen:
        return name in seen[parent]
    return False if parent and _present(seen, parent) is False else None


def _verify_objects(
    reg: Registry, report: VerifyReport, tree: Tree, seen: Seen, later: Later
) -> Sizes:
    """Re-hash every object, each fan-out directory opened once; the size of each object
    that is a regular file (None: present but not one), for the meta records' check."""
    sizes: Sizes = {}
    for fan, fan_kind in tree.get(layout.OBJECTS, []):
        fan_rel = f"{layout.OBJECTS}/{fan}"
        if fan_kind != "dir" or len(fan) != 2 or fan_rel not in tree:
            report.add("unexpected", fan_rel, "not an object fan-out")
            continue
        files, regular = [], later.get(fan_rel, set())
        for entry, kind in tree[fan_rel]:
            if entry in regular:
                files.append(entry)
                continue
            rel = f"{fan_rel}/{entry}"
            if (sha := layout.object_sha(rel)) is None:
                report.add("unexpected", rel, "not an object file")
                continue
            report.objects += 1
            if kind != "file":
                sizes[sha] = None
                what = "a FIFO, device or socket" if kind == "other" else f"a {kind}"
                report.add("corrupt", rel, f"object is {what}, not a regular file; refused")
        report.objects += len(files)
        try:
            with contextlib.closing(reg._disk.read_each(fan_rel, files)) as each:
                for entry, got in each:
                    _check_object(reg, report, f"{fan_rel}/{entry}", got, sizes, seen)
        except (FileNotFoundError, IntegrityError) as exc:  # replaced since it was listed
            report.add("symlink", fan_rel, str(exc))
    return sizes


def _check_object(
    reg: Registry, report: VerifyReport, rel: str, got: ReadResult, sizes: Sizes, seen: Seen
) -> None:
    sha = rel[-68:-4]
    if not isinstance(got, Exception):  # read: the common case first
        _check_read_object(reg, report, rel, sha, got, sizes, seen)
    elif isinstance(got, IntegrityError):
        sizes[sha] = None
        report.add("corrupt", rel, str(got))
    elif not isinstance(got, FileNotFoundError):  # that one: removed since the walk (a gc)
        raise got


def _check_read_object(
    reg: Registry, report: VerifyReport, rel: str, sha: str, got: Read, sizes: Sizes, seen: Seen
) -> None:
    data, st = got
    sizes[sha] = st.st_size
    if st.st_mode & 0o022:
        _check_mode(report, rel, "file", st)
    if hashlib.sha256(data).hexdigest() != sha:
        try:
            reg._objects.check(sha, data)  # says how, in the one message for it
        except IntegrityError as exc:
            report.add("corrupt", rel, str(exc))
        return
    if st.st_mode & 0o222:
        report.add("bad_mode", rel, "object is writable; objects must be read-only")
    metas = seen.get(layout.META)  # listed: a lookup; else not there, or not reachable
    missing = (
        f"{sha}.json" not in metas
        if metas is not None
        else _present(seen, f"{layout.META}/{sha}.json") is False
    )
    if missing:
        why = "object has no meta record (interrupted add?); add it again"
        report.add("incomplete", rel, why, "warning")


def _verify_meta(
    reg: Registry, report: VerifyReport, tree: Tree, sizes: Sizes, seen: Seen, later: Later
) -> None:
    files, regular = [], later.get(layout.META, set())
    for entry, _kind in tree.get(layout.META, []):
        if entry in regular:
            files.append(entry)
            continue
        rel = f"{layout.META}/{entry}"
        if layout.meta_sha(rel) is None:
            report.add("unexpected", rel, "not a meta record")
            continue
        files.append(entry)  # not a regular file: the read says what it is
    report.meta += len(files)
    try:
        listed, broken = reg._disk.legacy()[0], None
    except IntegrityError as exc:  # reported by the walk; no record can be told legacy
        listed, broken = {}, exc
    with contextlib.closing(reg._disk.read_each(layout.META, files)) as each:
        for entry, got in each if files else ():
            rel, sha = f"{layout.META}/{entry}", entry[:-5]
            if isinstance(got, FileNotFoundError):  # removed since the walk (a concurrent gc)
                continue
            if isinstance(got, Exception) and not isinstance(got, IntegrityError):
                raise got
            if broken is not None or isinstance(got, IntegrityError):
                report.add("bad_record", rel, str(broken or got))
                continue
            raw, st = got
            if st.st_mode & 0o022:
                _check_mode(report, rel, "file", st)
            want = listed.get(rel) if listed else None
            if want is not None and hashlib.sha256(raw).hexdigest() == want:
                report.legacy += 1  # history in the adopted registry's own shape
                continue
            if (recorded := Meta.plain_size(loads_flat(raw), sha)) is None:
                try:  # not the shape `add` writes: the strict reader judges it
                    recorded = reg._objects.parse_meta(sha, raw).bytes
                except IntegrityError as exc:
                    report.add("bad_record", rel, str(exc))
                    continue
            if sha not in sizes:
                if _present(seen, layout.object_relpath(sha)) is False:
                    report.add("orphan_meta", rel, "meta record without object")
            elif (size := sizes[sha]) is not None and size != recorded:
                report.add("bad_record", rel, f"records {recorded} bytes, object differs")


def _verify_names(reg: Registry, report: VerifyReport, tree: Tree, seen: Seen) -> None:
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
        missing = sha is not None and _present(seen, layout.object_relpath(sha)) is False
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

"""One destination's run (the state machine `run` drives): inspect, compare, apply, confirm.

Invariants:
- A destination is written only when it is missing (its parent present), empty, or a
  mirror (its own marker says role `mirror`); a new one gets its marker before anything.
- The plan is two itemized dry runs, objects by size and mtime, everything else by content
  (`--checksum`), and the sweep: the sha256 of every object at the destination, taken
  there; an object whose bytes do not hash to its name, or cannot be read, is sent again.
- `content` is `judge_copy`'s verdict and `verified` is read from it only; a destination's
  `mirror.log` line is one short line (`to_dict(log=...)`: no changes list).
- Objects travel first, regular files only, each hashed at the destination after sending
  and before any record that points to it is sent; names travel under the registry lock;
  deletions come last, objects' last of all.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, NamedTuple

from prefixreg.core.errors import IntegrityError, MirrorError
from prefixreg.core.jsonio import loads_object
from prefixreg.core.judge import CopyVerdict, judge_copy
from prefixreg.registry import fsutil, layout
from prefixreg.registry.layout import FRAMES, MARKER, META, NAMES, OBJECTS
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.verbs.mirror import rsync
from prefixreg.verbs.mirror.plan import Verify, objects_to_verify, referenced_objects, top
from prefixreg.verbs.mirror.rsync import VANISHED, Change, Destination, Mode, build_rsync_argv

_RECORD_TREES: Final = (OBJECTS, META, FRAMES, NAMES)
_UNLOGGED: Final = {"log": False}  # fields the mirror.log line leaves out


class PassRecord(NamedTuple):
    """One rsync step of a run and what it changed (what the ordering tests read)."""

    kind: str
    changes: list[Change]


@dataclass(slots=True)
class DestinationResult:
    """What happened at one destination. `hashed`: objects hashed there that matched their
    names (by the sweep or the read-back); `changed_in_place`: objects there that did not
    (sent again); `read_back`: objects sent, then hashed there."""

    destination: str
    result: str = "failed"
    sent: int = 0
    deleted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    content: CopyVerdict = "unchecked"
    hashed: int = 0
    changed_in_place: int = 0
    rounds: int = 0
    read_back: int = 0
    new: bool = field(default=False, metadata=_UNLOGGED)
    error: str | None = field(default=None, metadata=_UNLOGGED)
    changes: list[Change] = field(default_factory=list, metadata=_UNLOGGED)
    passes: list[PassRecord] = field(default_factory=list, metadata=_UNLOGGED)

    @property
    def ok(self) -> bool:
        return self.result in ("ok", "dry-run")

    @property
    def verified(self) -> bool:
        return self.content == "verified"

    def to_dict(self, *, log: int | None = None) -> dict[str, object]:
        """The --json form; with `log` (the run's objects verified), the `mirror.log` line."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata != _UNLOGGED}
        out |= {"seconds": round(self.seconds, 3), "verified": self.verified}
        if log is not None:
            error = {} if self.error is None else {"error": self.error}
            return {"at": iso_utc(utc_now()), **out, "objects_verified": log, **error}
        changes = [str(c) for c in self.changes]
        return out | {"ok": self.ok, "new": self.new, "error": self.error, "changes": changes}


class Session:
    """One destination's run: its ssh connection, its plan, its passes, its result."""

    def __init__(
        self, reg: Registry, dest: Destination, *, ssh_options: Sequence[str], bwlimit: int | None
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="prxm-")  # removed by `close`
        self.reg, self.dest, self.bwlimit = reg, dest, bwlimit
        self.workdir = Path(self._tmp.name)
        self.source = f"{reg.root}/"
        self.result = DestinationResult(destination=dest.raw)
        self.control = self.workdir / "cm"  # the run's one ssh connection
        ssh = rsync.build_ssh_command(ssh_options, control_path=str(self.control))
        self.rsh = ssh if dest.host is not None else None
        self.plan: list[Change] = []
        self.swept = False  # every object at the destination was hashed there
        self._started = time.monotonic()

    def close(self) -> None:
        """Stop the run's ssh connection, if one was opened; remove the work directory."""
        if self.rsh is not None and self.control.exists():
            with contextlib.suppress(MirrorError):
                exit_master = ["-o", f"ControlPath={self.control}", "-O", "exit"]
                rsync.run(["ssh", *exit_master, self.dest.ssh_host])
        self._tmp.cleanup()

    def _rsync(self, mode: Mode, source: str, dest: str, **options: Any) -> bytes:
        ok = (0,) if mode in ("list", "fetch", "marker") else (0, VANISHED)
        return rsync.run(build_rsync_argv(mode, source, dest, rsh=self.rsh, **options), ok_codes=ok)

    def _refused(self, why: str, hint: str | None = None) -> MirrorError:
        return MirrorError(f"destination {self.dest.raw} {why}; refusing", hint=hint)

    def _probe(self, mode: Mode, target: str, local: str = "") -> bytes | None:
        """A `list` or `fetch` of `target`; None when rsync finds no such directory there."""
        try:
            return self._rsync(mode, target, local)
        except MirrorError as exc:
            stderr = exc.stderr or ""
            if exc.returncode == 23 and ("No such file" in stderr or "Not a directory" in stderr):
                return None
            raise

    def _entries(self, listing: bytes) -> dict[str, str]:
        """{name: mode} of a `list`, read fail-closed: a line it cannot parse refuses."""
        entries = {}
        for line in filter(str.strip, listing.decode("utf-8", "replace").splitlines()):
            if (m := rsync.LIST_LINE_RE.fullmatch(line)) is None:
                why = f"cannot be inspected (rsync's listing says {line[:80]!r}), nothing deleted"
                raise self._refused(why)
            entries[m.group(2)] = m.group(1)
        return entries

    def inspect(self) -> None:
        """Refuse anything but a missing directory in an existing parent, an empty one, or a
        mirror. The marker is fetched first (for an existing mirror, the whole inspection);
        only without one is the top level listed: empty only on a positive answer."""
        local = self.workdir / "dest-marker.json"
        self._probe("fetch", self.dest.target(MARKER), str(local))  # no -l: a link is skipped
        if local.exists():
            return self._check_marker(local)
        if (listing := self._probe("list", self.dest.target())) is not None:
            entries = self._entries(listing)
            if not entries.pop(".", "").startswith("d"):
                why = "cannot be inspected (no '.' in rsync's listing), nothing deleted"
                raise self._refused(why)
            if MARKER in entries:
                raise self._refused(f"has a {MARKER} that is not a regular file")
            if entries:  # the worker's old hand-built copy (the seed's REMOTE_PATH), say
                path = self.dest.path
                raise MirrorError(
                    f"destination {self.dest.raw} holds files but is not a prefixreg mirror "
                    f"(no {MARKER}); refusing, nothing deleted: mirror to a new path, or, to "
                    f"keep what is there, adopt it on that host first (`prefixreg migrate "
                    f"{path} --repoint` moves it to a registry of its own and frees {path})"
                )
        elif (parent := self._probe("list", self.dest.parent.target())) is None:
            hint = "create it first: the mirror creates only the last directory"
            why = f"needs its parent directory {self.dest.parent.path}: it does not exist"
            raise self._refused(why, hint=hint)
        elif posixpath.basename(self.dest.path.rstrip("/")) in self._entries(parent):
            raise self._refused("is not a directory")
        self.result.new = True
        return None

    def _check_marker(self, local: Path) -> None:
        try:
            marker = loads_object(fsutil.read_nofollow(local), path=local)
        except IntegrityError as exc:
            raise self._refused(f"has an unreadable {MARKER} ({exc})") from None
        if layout.marker_problem(marker) is not None:
            raise self._refused(f"has no prefixreg {MARKER}")
        if (role := marker.get("role")) == "origin":
            hint = "mirrors flow from the coordinator's origin to workers only"
            raise self._refused("is an origin registry", hint=hint)
        if role != "mirror":
            raise self._refused(f"has role {role!r}, not a mirror")

    def write_marker(self) -> None:
        """Make a new destination a mirror before anything else arrives in it."""
        stage = self.workdir / "marker"
        stage.mkdir()
        (stage / MARKER).write_bytes(layout.encode_marker("mirror", iso_utc(utc_now())))
        (stage / MARKER).chmod(0o644)
        # The new root takes the source root's mode, so the first compare finds it equal.
        stage.chmod(self.reg.root.stat().st_mode & 0o7777)
        self._rsync("marker", f"{stage}/", self.dest.target())

    def _dry_run(self, mode: Mode) -> list[Change]:
        return rsync.parse_itemized(self._rsync(mode, self.source, self.dest.target()))

    def compare(self, objects: Future[list[Change]] | None = None) -> list[Change]:
        """Both itemized dry runs (of objects/: `objects`, when started), at once; one entry
        per path (both list a differing root)."""
        with ThreadPoolExecutor(1) as pool:
            objects = objects or pool.submit(self._dry_run, "compare-objects")
            records = self._dry_run("compare-records")
            return list(dict.fromkeys([*objects.result(), *records]))

    def prepare(self) -> None:
        """Inspect and plan: the objects/ dry run and the sweep (read-only) run during the
        marker fetch and count once it passed (a new destination is planned unswept). An
        object there that does not hash to its name is sent again (rsync's quick check
        cannot see a change in place)."""
        with ThreadPoolExecutor(2) as pool:
            objects = pool.submit(self._dry_run, "compare-objects")
            hashing = pool.submit(self.hash_objects)
            self.inspect()
            self.plan = self.compare(None if self.result.new else objects)
            if self.result.new:
                return
            found = hashing.result()
        planned = {c.path for c in self.plan}
        for rel, problem in sorted(found.items()):
            self.result.hashed += problem is None
            self.result.changed_in_place += problem is not None
            if problem is not None and rel not in planned:
                self.plan.append(Change(code=">fc........", bytes=0, path=rel))  # send it again
        self.swept = True

    def hash_objects(self, objects: Sequence[str] = ()) -> dict[str, str | None]:
        """`rsync.check_hashes` of `rsync.hash_argv`: hashed at the destination."""
        try:
            return rsync.check_hashes(rsync.run(rsync.hash_argv(self.dest, self.rsh, objects)))
        except MirrorError as exc:
            reason = rsync.first_error(exc.stderr or str(exc))
            raise MirrorError(f"{self.dest.raw}: cannot hash the objects there: {reason}") from None

    def read_back(self, paths: Sequence[str]) -> None:
        """Hash the objects `paths`, just sent, at the destination; `MirrorError` when one
        is not a regular file there whose bytes hash to its name."""
        found = self.hash_objects(paths)
        missing = "is not a regular file"
        problems = [f"{rel} {found.get(rel, missing)}" for rel in paths if found.get(rel, missing)]
        self.result.read_back += len(paths)
        self.result.hashed += len(paths) - len(problems)
        if problems:
            self.result.content = judge_copy(hashed=True, matched=False)
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            why = f"{problems[0]} at the destination{more}; nothing pointing to it was sent"
            raise MirrorError(f"{self.dest.raw}: after sending, {why}")

    def _pass(self, kind: str, paths: Sequence[str]) -> set[str]:
        """One `--files-from` step: the paths rsync itemized (a send: every listed path now
        there, by `-ii`; a delete: every path deleted); changes are recorded and counted, and
        every object sent is read back. Only "dirs" and "rest" may send other than regular
        files: nothing else replaces a good file."""
        if not paths:
            return set()
        listing = self.workdir / f"{kind}.list"
        listing.write_bytes(b"".join(os.fsencode(p) + b"\0" for p in paths))
        mode: Mode = "delete" if kind.startswith("delete") else "send"
        files = {"files_from": str(listing), "regular_only": kind not in ("dirs", "rest")}
        out = self._rsync(mode, self.source, self.dest.target(), bwlimit=self.bwlimit, **files)
        itemized = rsync.parse_itemized(out)
        changes = [c for c in itemized if not c.is_unchanged]
        self.result.passes.append(PassRecord(kind, changes))
        for c in changes:
            self.result.deleted += c.is_delete
            self.result.sent += c.kind == "file" and not c.is_delete
            self.result.bytes += c.bytes
        sent = [c.path for c in changes if not c.is_delete and layout.object_sha(c.path)]
        if sent:
            self.read_back(sorted(sent))
        return {c.path for c in itemized}

    def apply(self, plan: Sequence[Change], verify: Verify) -> None:
        """One round, in the order that keeps DESIGN §3's reader promise: 1. the record
        directories, then objects (verified first; one gc removed since the plan is left
        out); 2. meta and frame records, each once what it points to is at the destination;
        3. the same for names, under the registry lock, reading what they point to *now*;
        4. everything else, outside the lock (a slow link never holds up an agent loop's
        `add(name=...)`); 5. deletions of paths still missing at the source, objects last,
        and those only when every planned record change happened (else the next round
        plans afresh), never of an object a record sent in this round points to."""
        sends = [c for c in plan if not c.is_delete]
        dirs = sorted(c.path for c in sends if c.kind == "dir" and top(c.path) in _RECORD_TREES)
        here = self._pass("dirs", dirs)
        here |= self._pass("objects", verify(objects_to_verify(sends)))
        referenced: set[str] = set()
        done: set[str] = set()
        for step, trees in (("meta", (META, FRAMES)), ("names", (NAMES,))):
            records = [c for c in sends if top(c.path) in trees and c.kind != "dir"]
            if not records:
                continue
            # Names only move under the registry lock (and gc only removes under it): the
            # names read now are the names sent, so everything they point to is there first.
            with self.reg.lock("registry") if step == "names" else contextlib.nullcontext():
                needs = referenced_objects(self.reg, records, verify)
                wanted = set().union(*needs.values())
                objects = sorted(p for p in wanted - here if top(p) == OBJECTS)
                here |= self._pass(f"{step}-objects", verify(objects))
                here |= self._pass(f"{step}-frames", sorted(wanted - here - set(objects)))
                referenced |= wanted
                ready = [c.path for c in records if needs.get(c.path, set()) <= here]
                done |= self._pass(step, ready)
        self._pass("rest", [c.path for c in sends if top(c.path) not in _RECORD_TREES])
        done |= self._pass("delete", [c.path for c in plan if c.is_delete and not c.is_object])
        if not {c.path for c in plan if top(c.path) in (META, NAMES) and "/" in c.path} <= done:
            # A record there is not what the plan expected: it may still point to an
            # object planned for deletion.
            self.result.passes.append(PassRecord("delete-objects-postponed", []))
            return
        kept = referenced | {posixpath.dirname(rel) for rel in referenced}
        doomed = [c.path for c in plan if c.is_delete and c.is_object and c.path not in kept]
        self._pass("delete-objects", doomed)

    def finish(self, result: str, error: str | None = None) -> DestinationResult:
        self.result.result, self.result.error = result, error
        self.result.seconds = time.monotonic() - self._started
        return self.result

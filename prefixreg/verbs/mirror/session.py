"""One destination's run: inspect it, compare and hash, apply a plan in the reader-safe order.

Role: the per-destination state machine of a mirror run (`run` drives it, destinations in
parallel). Every rsync and every hash at the destination goes through `rsync.run`.

Invariants:
- A destination is written only when it is missing (its parent present), empty, or a
  mirror (its own marker says role `mirror`); a new one gets its marker before anything.
- The plan is two itemized dry runs, objects by size and mtime, everything else by content
  (`--checksum`), and (the sweep) the sha256 of every object at the destination, taken
  there: an object whose bytes do not hash to its name, or cannot be read, is sent again.
- Objects travel first, regular files only, and each object sent is hashed at the
  destination before any name or meta record that points to it is sent.
- A name or meta record travels only once its object is confirmed at the destination;
  names travel under the registry lock; deletions come last, objects' last of all.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import IntegrityError, MirrorError
from prefixreg.core.jsonio import loads_object
from prefixreg.core.judge import judge_copy
from prefixreg.registry import fsutil, layout
from prefixreg.registry.layout import FRAMES, MARKER, META, NAMES, OBJECTS, object_relpath
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.verbs.mirror import rsync
from prefixreg.verbs.mirror.plan import Verify, objects_to_verify, referenced_objects, top
from prefixreg.verbs.mirror.report import DestinationResult, PassRecord
from prefixreg.verbs.mirror.rsync import VANISHED, Change, Destination, Mode, build_rsync_argv
from prefixreg.verbs.mirror.ssh import ControlMaster

_RECORD_TREES: Final = (OBJECTS, META, FRAMES, NAMES)
# The plan entry of an object the sweep found changed in place: a file to send again.
_CHANGED: Final = ">fc" + "." * 8


def _missing(exc: MirrorError) -> bool:
    """rsync's answer for a path that does not exist, or has a file where a directory is."""
    stderr = exc.stderr or ""
    return exc.returncode == 23 and ("No such file" in stderr or "Not a directory" in stderr)


class Session:
    """Everything one destination's run needs: its rsh, its control master, its passes."""

    def __init__(
        self,
        reg: Registry,
        dest: Destination,
        *,
        ssh_options: Sequence[str],
        bwlimit: int | None,
        workdir: Path,
    ) -> None:
        self.reg, self.dest, self.bwlimit, self.workdir = reg, dest, bwlimit, workdir
        self.source = f"{reg.root}/"
        self.result = DestinationResult(destination=dest.raw)
        self.master = ControlMaster(dest, ssh_options, workdir) if dest.is_remote else None
        self.rsh: list[str] | None = None
        self.plan: list[Change] = []
        self.swept = False  # every object at the destination was hashed there
        self._started = time.monotonic()

    def open(self) -> None:
        """Start the shared ssh connection; this is where "cannot authenticate" surfaces."""
        if self.master is not None:
            self.rsh = self.master.open()

    def close(self) -> None:
        if self.master is not None:
            self.master.close()

    def _rsync(self, mode: Mode, source: str, dest: str, **options: Any) -> bytes:
        # Exit 24: a file vanished at the source while rsync walked it (a concurrent gc).
        ok = (0,) if mode in ("list", "fetch", "marker") else (0, VANISHED)
        return rsync.run(build_rsync_argv(mode, source, dest, rsh=self.rsh, **options), ok_codes=ok)

    def inspect(self) -> None:
        """Refuse anything but a missing directory in an existing parent, an empty one, or a
        mirror registry.

        The marker is fetched first: for an existing mirror (every run but the first) that
        one small rsync is the whole inspection. Only without a readable marker is the top
        level listed, to tell a missing or empty directory from one holding other things.
        """
        local = self.workdir / "dest-marker.json"
        try:
            self._rsync("fetch", self.dest.target(MARKER), str(local))
        except MirrorError as exc:
            if not _missing(exc):
                raise
        if local.exists():
            return self._check_marker(local)
        try:
            listing = self._rsync("list", self.dest.target(), "")
        except MirrorError as exc:
            if not _missing(exc):
                raise
            try:
                self._rsync("list", self.dest.parent.target(), "")
            except MirrorError as parent_exc:
                if not _missing(parent_exc):
                    raise
                raise MirrorError(
                    f"destination {self.dest.raw}: its parent directory {self.dest.parent.path} "
                    "does not exist (or is not a directory); create it first (the mirror "
                    "creates only the last directory)"
                ) from None
            if "Not a directory" in (exc.stderr or ""):
                raise MirrorError(f"destination {self.dest.raw} is not a directory") from None
            self.result.new = True
            return None
        # Fail closed: the directory counts as empty only on a positive answer, i.e. the
        # listing parsed line by line shows the directory itself and nothing else.
        entries: dict[str, str] = {}
        for line in filter(str.strip, listing.decode("utf-8", "replace").splitlines()):
            m = rsync.LIST_LINE_RE.fullmatch(line)
            if m is None:
                raise MirrorError(
                    f"destination {self.dest.raw}: cannot read rsync's listing ({line[:80]!r}); "
                    "refusing, nothing deleted"
                )
            entries[m.group(2)] = m.group(1)
        if not entries.pop(".", "").startswith("d"):
            raise MirrorError(
                f"destination {self.dest.raw}: rsync's listing does not show the directory "
                "itself; refusing, nothing deleted"
            )
        if MARKER in entries:
            raise MirrorError(f"destination {self.dest.raw}: {MARKER} is not a regular file")
        if entries:
            raise MirrorError(
                f"destination {self.dest.raw} holds files but is not a prefixreg mirror "
                f"(no {MARKER}); refusing, nothing deleted"
            )
        self.result.new = True
        return None

    def _check_marker(self, local: Path) -> None:
        try:
            marker = loads_object(fsutil.read_nofollow(local), path=local)
        except IntegrityError as exc:
            raise MirrorError(f"destination {self.dest.raw}: unreadable {MARKER} ({exc})") from None
        role = marker.get("role")
        if layout.marker_problem(marker) is not None:
            raise MirrorError(f"destination {self.dest.raw}: not a prefixreg {MARKER}; refusing")
        if role == "origin":
            raise MirrorError(
                f"destination {self.dest.raw} is an origin registry; refusing to mirror onto it",
                hint="mirrors flow from the coordinator's origin to workers only",
            )
        if role != "mirror":
            raise MirrorError(f"destination {self.dest.raw}: role {role!r} is not a mirror")

    def write_marker(self) -> None:
        """Make a new destination a mirror before anything else arrives in it."""
        stage = self.workdir / "marker"
        stage.mkdir()
        (stage / MARKER).write_bytes(layout.encode_marker("mirror", iso_utc(utc_now())))
        (stage / MARKER).chmod(0o644)
        # The new root takes the source root's mode, so the first compare finds it equal.
        stage.chmod(self.reg.root.stat().st_mode & 0o7777)
        self._rsync("marker", f"{stage}/", self.dest.target())

    def compare(self, *, sweep: bool = False) -> list[Change]:
        """The plan: both itemized dry runs and, with `sweep`, the hash of every object at
        the destination, all three at once. An object there that does not hash to its name
        is planned to be sent again: rsync's quick check cannot see a change in place."""
        with ThreadPoolExecutor(3) as pool:
            modes: tuple[Mode, ...] = ("compare-objects", "compare-records")
            runs = [pool.submit(self._rsync, m, self.source, self.dest.target()) for m in modes]
            hashing = pool.submit(self.hash_objects, [OBJECTS]) if sweep else None
            plan = list(
                {c.path: c for r in runs for c in rsync.parse_itemized(r.result())}.values()
            )
            if hashing is None:
                return plan
            listed, hashes = hashing.result()
        planned = {c.path for c in plan}
        for rel in sorted(listed | hashes.keys()):
            matched = hashes.get(rel) == layout.object_sha(rel)
            self.result.hashed += matched
            self.result.changed_in_place += not matched
            if not matched and rel not in planned:
                plan.append(Change(_CHANGED, 0, rel))
        self.swept = True
        return plan

    def hash_objects(self, starts: Sequence[str]) -> tuple[set[str], dict[str, str]]:
        """(object paths listed, {path: sha256}) below `starts`, hashed at the destination."""
        try:
            return rsync.parse_hashes(rsync.run(rsync.hash_argv(self.dest, self.rsh, starts)))
        except MirrorError as exc:
            reason = rsync.first_error(exc.stderr or str(exc))
            raise MirrorError(f"{self.dest.raw}: cannot hash the objects there: {reason}") from None

    def read_back(self, paths: Sequence[str]) -> None:
        """Hash the objects `paths`, just sent, at the destination.

        Raises:
            MirrorError: one of them is not, at the destination, a regular file whose
                bytes hash to its name (nothing that points to it is sent).
        """
        listed, hashes = self.hash_objects(sorted({posixpath.dirname(p) for p in paths}))
        problems = []
        for rel in paths:
            if (got := hashes.get(rel)) != layout.object_sha(rel):
                what = "cannot be read" if rel in listed else "is not a regular file"
                problems.append(f"{rel} hashes to {got}" if got else f"{rel} {what}")
        self.result.read_back += len(paths)
        self.result.hashed += len(paths) - len(problems)
        if problems:
            self.result.content = judge_copy(hashed=True, matched=False)
            raise MirrorError(
                f"{self.dest.raw}: after sending, {problems[0]} at the destination"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; names and records pointing to it were not sent"
            )

    def _pass(self, kind: str, paths: Sequence[str]) -> set[str]:
        """One `--files-from` step; returns the paths rsync itemized.

        For a send that is every listed path now at the destination (sent or already
        equal, thanks to `-ii`); for a delete, every path it deleted. Only real changes
        are recorded in `passes` and counted. An object, meta or names pass sends regular
        files only: a path that turned into anything else at the source since it was
        checked is skipped, so it never replaces a good file at the destination.
        """
        if not paths:
            return set()
        listing = self.workdir / f"{kind}.list"
        listing.write_bytes(b"".join(os.fsencode(p) + b"\0" for p in paths))
        mode: Mode = "delete" if kind.startswith("delete") else "send"
        out = self._rsync(
            mode,
            self.source,
            self.dest.target(),
            files_from=str(listing),
            bwlimit=self.bwlimit,
            regular_only=kind not in ("dirs", "rest"),  # the other passes: files only
        )
        itemized = rsync.parse_itemized(out)
        changes = [c for c in itemized if not c.is_unchanged]
        self.result.passes.append(PassRecord(kind, changes))
        for c in changes:
            self.result.deleted += c.is_delete
            self.result.sent += c.is_file and not c.is_delete
            self.result.bytes += c.bytes
        return {c.path for c in itemized}

    def _send_objects(self, kind: str, paths: Sequence[str]) -> set[str]:
        """An object pass, then the read-back of every object it sent or changed (of any
        kind: a directory arriving at an object's path fails the read-back)."""
        first = len(self.result.passes)
        here = self._pass(kind, paths)
        sent = {
            c.path
            for record in self.result.passes[first:]
            for c in record.changes
            if not c.is_delete and layout.object_sha(c.path) is not None
        }
        if sent:
            self.read_back(sorted(sent))
        return here

    def apply(self, plan: Sequence[Change], verify: Verify) -> None:
        """One round, in the order that keeps DESIGN §3's reader promise.

        1. the directories of objects/, meta/ and names/, then objects (verified first,
           regular files only; an object gc removed since the plan is left out), each
           hashed at the destination;
        2. meta and frame records, each only once what it points to is confirmed at the
           destination (sent now, already equal, or sent by a step for them);
        3. under the registry lock, the same for names: the objects and frame records they
           point to *now*, then the names whose targets are all there;
        4. everything else (measurements, probes, journals), outside the lock so a slow
           link never holds up an agent loop's `add(name=...)`;
        5. deletions of non-objects, then of objects, each only of paths still missing at
           the source. Object deletions wait for the next round when a planned name or
           meta change did not happen as planned (a name came back, a record vanished),
           and never remove an object a record sent in this round points to.
        """
        sends = [c for c in plan if not c.is_delete]
        dirs = sorted(c.path for c in sends if c.is_dir and top(c.path) in _RECORD_TREES)
        here = self._pass("dirs", dirs)
        here |= self._send_objects("objects", verify(objects_to_verify(sends)))
        referenced: set[str] = set()
        done: set[str] = set()
        for step, trees in (("meta", (META, FRAMES)), ("names", (NAMES,))):
            records = [c for c in sends if top(c.path) in trees and not c.is_dir]
            if not records:
                continue
            # Names only move under the registry lock (and gc only removes under it): the
            # names read now are the names sent, so everything they point to is there first.
            lock = self.reg.lock("registry") if step == "names" else contextlib.nullcontext()
            with lock:
                needs = referenced_objects(self.reg, records, verify)
                wanted = set().union(*needs.values())
                objects = sorted(p for p in wanted - here if top(p) == OBJECTS)
                here |= self._send_objects(f"{step}-objects", verify(objects))
                here |= self._pass(f"{step}-frames", sorted(wanted - here - set(objects)))
                referenced |= wanted
                ready = [c.path for c in records if needs.get(c.path, set()) <= here]
                done |= self._pass(step, ready)
        self._pass("rest", [c.path for c in sends if top(c.path) not in _RECORD_TREES])

        done |= self._pass("delete", [c.path for c in plan if c.is_delete and not c.is_object])
        if not {c.path for c in plan if top(c.path) in (META, NAMES) and "/" in c.path} <= done:
            # Some name or meta record at the destination is not what the plan expected;
            # it may still point to an object planned for deletion. The next round's
            # compare plans it afresh.
            self.result.passes.append(PassRecord("delete-objects-postponed", []))
            return
        kept = referenced | {posixpath.dirname(rel) for rel in referenced}
        doomed = [c.path for c in plan if c.is_delete and c.is_object and c.path not in kept]
        self._pass("delete-objects", doomed)

    def finish(self, result: str, error: str | None = None) -> DestinationResult:
        self.result.result, self.result.error = result, error
        self.result.seconds = time.monotonic() - self._started
        return self.result

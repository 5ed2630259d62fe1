"""One destination's run: inspect it, compare, apply a plan in the reader-safe order, confirm.

Role: the per-destination state machine of a mirror run (`verbs.mirror.run` drives it and
runs destinations in parallel). Every rsync goes through `verbs.rsync` (argv builder, one
runner); paths and parses come from `registry.layout`.

Invariants:
- A destination is written only when it is missing, empty, or a mirror (its own marker
  says role `mirror`); a new one gets its marker before anything else.
- Objects travel first, regular files only, and each object sent is read back from the
  destination and hashed before any name or meta record that points to it is sent.
- A name or meta record travels only once its object is confirmed at the destination;
  names travel under the registry lock; deletions come last, objects' last of all.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, MirrorError
from prefixreg.core.jsonio import loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.layout import (
    FRAMES,
    MARKER,
    META,
    NAMES,
    OBJECTS,
    frame_relpath,
    frame_sha,
    meta_sha,
    object_relpath,
    object_sha,
)
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.verbs.mirror.plan import (
    Verify,
    frame_parts_of,
    objects_to_verify,
    referenced_objects,
    top,
)
from prefixreg.verbs.mirror.report import DestinationResult, PassRecord
from prefixreg.verbs.mirror.rsync import (
    LIST_LINE_RE,
    VANISHED,
    Change,
    Destination,
    Mode,
    build_rsync_argv,
    parse_itemized,
    run_rsync,
)
from prefixreg.verbs.mirror.ssh import ControlMaster
from prefixreg.verbs.mirror.verifier import check_read_back

__all__ = ["OBJECT_PASSES", "REGULAR_PASSES", "Session"]

# Passes that send object files: each object they send is read back afterwards.
OBJECT_PASSES: Final = frozenset({"objects", "meta-objects", "frame-objects", "referenced-objects"})
# Passes that send regular files only (their directories travel first, in "dirs").
REGULAR_PASSES: Final = OBJECT_PASSES | {"meta", "frames", "referenced-frames", "names"}
_RECORD_TREES: Final = (OBJECTS, META, FRAMES, NAMES)


class Session:
    """Everything one destination's run needs: its rsh, its control master, its passes."""

    def __init__(
        self,
        reg: Registry,
        dest: Destination,
        *,
        ssh_options: Sequence[str],
        full_verify: bool,
        bwlimit: int | None,
        workdir: Path,
    ) -> None:
        self.reg = reg
        self.dest = dest
        self.full_verify = full_verify
        self.bwlimit = bwlimit
        self.workdir = workdir
        self.source = f"{reg.root}/"
        self.result = DestinationResult(destination=dest.raw, checksum=full_verify)
        self.master = ControlMaster(dest, ssh_options, workdir) if dest.is_remote else None
        self.rsh: list[str] | None = None
        self.plan: list[Change] = []
        self._read_backs = 0
        self._started = time.monotonic()

    def open(self) -> None:
        """Start the shared ssh connection; this is where "cannot authenticate" surfaces."""
        if self.master is not None:
            self.rsh = self.master.open()

    def close(self) -> None:
        if self.master is not None:
            self.master.close()

    # inspection -------------------------------------------------------------------------

    def inspect(self) -> None:
        """Refuse anything but a missing or empty directory or a mirror registry.

        The marker is fetched first: for an existing mirror (every run but the first) that
        one small rsync is the whole inspection. Only without a readable marker is the top
        level listed, to tell a missing or empty directory from one holding other things.
        """
        local = self.workdir / "dest-marker.json"
        try:
            # No -l: a symlinked marker is skipped (and then refused below), never followed.
            run_rsync(build_rsync_argv("fetch", self.dest.target(MARKER), str(local), rsh=self.rsh))
        except MirrorError as exc:
            if not (exc.returncode == 23 and "No such file or directory" in (exc.stderr or "")):
                raise
        if local.exists():
            self._check_marker(local)
            return
        argv = build_rsync_argv("list", self.dest.target(), "", rsh=self.rsh)
        try:
            listing = run_rsync(argv)
        except MirrorError as exc:
            stderr = exc.stderr or ""
            if exc.returncode == 23 and "No such file or directory" in stderr:
                self.result.new = True
                return
            if exc.returncode == 23 and "Not a directory" in stderr:
                raise MirrorError(f"destination {self.dest.raw} is not a directory") from None
            raise
        # Fail closed: the directory counts as empty only on a positive answer, i.e. the
        # listing parsed line by line shows the directory itself and nothing else.
        entries: dict[str, str] = {}
        for line in listing.stdout.decode("utf-8", "replace").splitlines():
            if not line.strip():
                continue
            m = LIST_LINE_RE.fullmatch(line)
            if m is None:
                raise MirrorError(
                    f"destination {self.dest.raw}: cannot read rsync's listing ({line[:80]!r}); "
                    "refusing, nothing deleted"
                )
            entries[m.group(2)] = m.group(1)
        if not entries.get(".", "").startswith("d"):
            raise MirrorError(
                f"destination {self.dest.raw}: rsync's listing does not show the directory "
                "itself; refusing, nothing deleted"
            )
        del entries["."]
        if not entries:
            self.result.new = True
            return
        if MARKER in entries:
            raise MirrorError(f"destination {self.dest.raw}: {MARKER} is not a regular file")
        raise MirrorError(
            f"destination {self.dest.raw} holds files but is not a prefixreg mirror "
            f"(no {MARKER}); refusing, nothing deleted"
        )

    def _check_marker(self, local: Path) -> None:
        try:
            marker = loads_object(fsutil.read_nofollow(local), path=local)
        except IntegrityError as exc:
            raise MirrorError(f"destination {self.dest.raw}: unreadable {MARKER} ({exc})") from None
        if layout.marker_problem(marker) is not None:
            raise MirrorError(f"destination {self.dest.raw}: not a prefixreg {MARKER}; refusing")
        role = marker.get("role")
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
        run_rsync(build_rsync_argv("marker", f"{stage}/", self.dest.target(), rsh=self.rsh))

    # passes ---------------------------------------------------------------------------

    def compare(self) -> list[Change]:
        argv = build_rsync_argv(
            "compare", self.source, self.dest.target(), rsh=self.rsh, checksum=self.full_verify
        )
        # Exit 24: a file vanished at the source while rsync walked it (a concurrent gc).
        return parse_itemized(run_rsync(argv, ok_codes=(0, VANISHED)).stdout)

    def _listing(self, kind: str, paths: Sequence[str]) -> Path:
        listing = self.workdir / f"{kind}.list"
        listing.write_bytes(b"".join(os.fsencode(p) + b"\0" for p in paths))
        return listing

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
        mode: Mode = "delete" if kind.startswith("delete") else "send"
        argv = build_rsync_argv(
            mode,
            self.source,
            self.dest.target(),
            rsh=self.rsh,
            files_from=str(self._listing(kind, paths)),
            bwlimit=self.bwlimit,
            checksum=self.full_verify,
            regular_only=kind in REGULAR_PASSES,
        )
        itemized = parse_itemized(run_rsync(argv, ok_codes=(0, VANISHED)).stdout)
        changes = [c for c in itemized if not c.is_unchanged]
        self.result.passes.append(PassRecord(kind, changes))
        for c in changes:
            if c.is_delete:
                self.result.deleted += 1
            elif c.is_file:
                self.result.sent += 1
                self.result.bytes += c.bytes
        return {c.path for c in itemized}

    def _send_objects(self, kind: str, paths: Sequence[str]) -> set[str]:
        """An object pass, then the read-back of every object it sent or changed."""
        first = len(self.result.passes)
        here = self._pass(kind, paths)
        sent = sorted(
            {
                c.path
                for record in self.result.passes[first:]
                for c in record.changes
                # Any kind: a directory arriving at an object's path fails the read-back.
                if not c.is_delete and object_sha(c.path) is not None
            }
        )
        self.read_back(sent)
        return here

    def read_back(self, paths: Sequence[str]) -> None:
        """Fetch the objects `paths` back from the destination and hash them here.

        Raises:
            MirrorError: one of them is not, at the destination, a regular file whose
                bytes hash to its name (nothing that points to it is sent).
        """
        if not paths:
            return
        self._read_backs += 1
        local = self.workdir / f"read-back-{self._read_backs}"
        local.mkdir()
        try:
            listing = self._listing("read-back", paths)
            argv = build_rsync_argv(
                "readback", self.dest.target(), f"{local}/", rsh=self.rsh, files_from=str(listing)
            )
            run_rsync(argv)
            problems = check_read_back(local, paths)
        finally:
            shutil.rmtree(local, ignore_errors=True)
        self.result.read_back += len(paths)
        if problems:
            raise MirrorError(
                f"{self.dest.raw}: after sending, {problems[0]} at the destination"
                + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; names and records pointing to it were not sent"
            )

    def apply(self, plan: Sequence[Change], verify: Verify) -> None:
        """One round, in the order that keeps DESIGN §3's reader promise.

        1. the directories of objects/, meta/ and names/, then objects (verified first,
           regular files only; an object gc removed since the plan is left out), each read
           back from the destination and hashed;
        2. meta records, each only once its object is confirmed at the destination (sent
           now, already equal, or sent by a step for the objects the records point to);
        3. under the registry lock (names only move under it, and gc only removes under
           it): the objects the names point to *now*, then the names: the names read
           are the names sent, so every object they point to is there first;
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

        meta = [c for c in sends if top(c.path) == META and not c.is_dir]
        names = [c for c in sends if top(c.path) == NAMES and not c.is_dir]
        rest = [c.path for c in sends if top(c.path) not in _RECORD_TREES]
        referenced: set[str] = set()
        done: set[str] = set()
        if meta:
            shas = referenced_objects(self.reg, meta, verify)
            referenced |= {object_relpath(sha) for sha in shas}
            here |= self._send_objects("meta-objects", verify(sorted(referenced - here)))
            ready = [
                c.path
                for c in meta
                if (sha := meta_sha(c.path)) is None or object_relpath(sha) in here
            ]
            done |= self._pass("meta", ready)
        frame_records = [c for c in sends if top(c.path) == FRAMES and not c.is_dir]
        if frame_records:
            # A frame record travels only after its parts are confirmed at the destination.
            parts: set[str] = set()
            for c in frame_records:
                sha = frame_sha(c.path)
                found = None if sha is None else frame_parts_of(self.reg, sha)
                parts |= {object_relpath(p) for p in found or ()}
            here |= self._send_objects("frame-objects", verify(sorted(parts - here)))
            referenced |= parts
            if parts <= here:
                here |= self._pass("frames", [c.path for c in frame_records])
        if names:
            with self.reg.lock("registry"):
                named_frames: set[str] = set()
                shas = referenced_objects(self.reg, names, verify, named_frames)
                needed = sorted({object_relpath(sha) for sha in shas} - here)
                here |= self._send_objects("referenced-objects", verify(needed))
                frame_files = sorted({frame_relpath(f) for f in named_frames} - here)
                here |= self._pass("referenced-frames", frame_files)
                missing = [rel for rel in [*needed, *frame_files] if rel not in here]
                if missing:
                    raise MirrorError(
                        f"{self.dest.raw}: {missing[0]} did not arrive; names not sent"
                    )
                referenced |= {object_relpath(sha) for sha in shas}
                done |= self._pass("names", [c.path for c in names])
        self._pass("rest", rest)

        deletions = [c.path for c in plan if c.is_delete and not c.is_object]
        done |= self._pass("delete", deletions)
        records = {c.path for c in plan if top(c.path) in (META, NAMES) and c.path != top(c.path)}
        if not records <= done:
            # Some name or meta record at the destination is not what the plan expected;
            # it may still point to an object planned for deletion. The next round's
            # compare plans it afresh.
            self.result.passes.append(PassRecord("delete-objects-postponed", []))
            return
        kept_dirs = {posixpath.dirname(rel) for rel in referenced}
        self._pass(
            "delete-objects",
            [
                c.path
                for c in plan
                if c.is_delete
                and c.is_object
                and c.path not in referenced
                and c.path not in kept_dirs
            ],
        )

    def finish(self, result: str, error: str | None = None) -> DestinationResult:
        self.result.result = result
        self.result.error = error
        self.result.seconds = time.monotonic() - self._started
        return self.result

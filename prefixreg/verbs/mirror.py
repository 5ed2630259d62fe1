"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature:

- The source must be an origin registry (`REGISTRY.json` role `origin`) holding objects.
- A destination must be a local path or `[user@]host:path`, never start with `-`, and be
  missing, empty, or a mirror (its own `REGISTRY.json` says role `mirror`). An origin
  registry or a directory holding anything else is refused before anything is written;
  the destination counts as empty only when rsync's listing positively says so.
- Destinations are de-duplicated (local paths resolved first); nested destinations, and a
  local one that is, holds or lies inside the source (`/` included), are refused.
- Every object about to be sent is re-hashed first (all of them with `full_verify`); one
  failure refuses the whole run and no destination is touched (`IntegrityError`, exit 3).

How a run goes, per destination (destinations run in parallel; one failing stops nothing):

1. compare: an itemized `rsync -a --delete --dry-run` (with `--checksum` under
   `full_verify`). Its output is the plan; when it is empty the destination already equals
   the source and that dry run *is* the confirmation, so a no-change run costs one pass.
2. apply the plan in an order that keeps the reader promise of DESIGN §3, each step a
   `--files-from` rsync of just the listed paths (cost grows with the change, not the tree):
   objects; meta records once their objects are confirmed at the destination; then, under
   the registry lock (names only move under it) and only for as long as that takes, the
   objects every name about to be sent points to and the names; then the other files
   (measurements, probes, journals) outside the lock; then deletions of non-objects;
   objects last. Deletion passes only delete paths still missing at the source and never
   send anything. A reader on the worker therefore never sees a name or meta record whose
   object has not arrived, and nothing is deleted before everything new is in place.
3. confirm: the compare dry run again; it must list nothing. If the origin changed during
   the run it lists those changes and another round applies them (at most `max_rounds`).

"Verified" means that confirming dry run found no difference: by size and mtime (rsync's
quick check) by default, by content (`--checksum`) with `full_verify`. Objects are always
re-hashed at the source before they travel.

A source file that vanishes during a run (a concurrent `gc`) is skipped and left to the
confirm pass; an unreadable one fails the destination (exit 6, with a `mirror.log` line).

`REGISTRY.json` never travels (the destination keeps its own, role `mirror`, written
before anything else), nor do `.locks/`, temp files or `mirror.log`; excluded paths are
also protected from deletion. Each destination's run appends one JSON line to the source's
`mirror.log`. rsync runs from an argv list (`verbs.rsync`: a pure argv builder) through one thin
runner; never a shell. Remote destinations share one ssh connection per run (an explicit
`ControlMaster`, which is also where an authentication failure is reported).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Final

from prefixreg.core.digest import is_full_sha, object_sha
from prefixreg.core.errors import (
    IntegrityError,
    MirrorError,
    PrefixregError,
    RefNotFoundError,
    RegistryLocationError,
    UsageError,
)
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil
from prefixreg.registry.store import FORMAT, FORMAT_VERSION, MARKER, Registry, iso_utc, utc_now
from prefixreg.verbs.rsync import (
    LIST_LINE_RE,
    VANISHED,
    Change,
    Destination,
    Mode,
    build_rsync_argv,
    build_ssh_command,
    first_error,
    parse_destination,
    parse_itemized,
    parse_ssh_options,
    run_rsync,
)

__all__ = [
    "DestinationResult",
    "MirrorReport",
    "PassRecord",
    "mirror",
]

ENV_TO: Final = "PREFIXREG_MIRROR_TO"
ENV_SSH_OPTS: Final = "PREFIXREG_SSH_OPTS"


@dataclass(slots=True)
class PassRecord:
    """One rsync step of a run, with what it did (kept for the ordering tests and --debug)."""

    kind: str
    changes: list[Change]


@dataclass(slots=True)
class DestinationResult:
    """What happened at one destination; `result` is ok, failed, refused or dry-run."""

    destination: str
    result: str = "failed"
    sent: int = 0
    deleted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    checksum: bool = False
    rounds: int = 0
    new: bool = False
    error: str | None = None
    changes: list[Change] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result in ("ok", "dry-run")

    def _fields(self) -> dict[str, object]:
        return {
            "destination": self.destination,
            "result": self.result,
            "sent": self.sent,
            "deleted": self.deleted,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "verified": self.verified,
            "checksum": self.checksum,
            "rounds": self.rounds,
        }

    def log_record(self, objects_verified: int) -> dict[str, object]:
        """The `mirror.log` line for this destination."""
        record = {"at": iso_utc(utc_now()), **self._fields(), "objects_verified": objects_verified}
        if self.error is not None:
            record["error"] = self.error
        return record

    def to_dict(self) -> dict[str, object]:
        """The `--json` form: the log fields plus whether it was new and what changed."""
        return {
            **self._fields(),
            "ok": self.ok,
            "new": self.new,
            "error": self.error,
            "changes": [str(c) for c in self.changes],
        }


@dataclass(slots=True)
class MirrorReport:
    """The whole run: `objects_verified` counts objects re-hashed before sending."""

    source: str
    dry_run: bool
    full_verify: bool
    objects_verified: int = 0
    results: list[DestinationResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r.destination for r in self.results if not r.ok]

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "ok": self.ok,
            "dry_run": self.dry_run,
            "full_verify": self.full_verify,
            "objects_verified": self.objects_verified,
            "failed": self.failed,
            "destinations": [r.to_dict() for r in self.results],
        }


# -- guards ---------------------------------------------------------------------------


def check_source(reg: Registry) -> None:
    """Refuse a source that is not an origin registry holding objects (`MirrorError`)."""
    try:
        role = reg.role
    except (RegistryLocationError, IntegrityError) as exc:
        raise MirrorError(f"source {reg.root} is not a usable registry: {exc}") from None
    if role is None:
        raise MirrorError(f"source {reg.root} is not a registry (no {MARKER}); refusing")
    if role != "origin":
        raise MirrorError(
            f"source {reg.root} is a {role}, not an origin registry; mirrors only flow "
            "from the coordinator's origin",
            hint="run the mirror on the coordinator, with --registry pointing at the origin",
        )
    if next(reg.iter_shas(), None) is None:
        raise MirrorError(f"source {reg.root} holds no objects; refusing to mirror (--delete)")


def _check_overlap(source: Path, dest: Destination) -> None:
    """Refuse a local destination that is, contains, or lies inside the source (`/` too)."""
    if dest.is_remote:
        return
    src, dst = source.resolve(), Path(dest.path).resolve()
    if src.is_relative_to(dst) or dst.is_relative_to(src):
        raise MirrorError(f"destination {dest.raw} overlaps the source {source}; refusing")


def _dedupe(parsed: Sequence[Destination]) -> list[Destination]:
    """Drop repeated destinations (by host and normalised path); refuse nested ones.

    Two spellings of one directory would run two rsyncs into it at once; a destination
    inside another would be deleted by the outer one's `--delete` and recreated by its own.
    Local paths are already resolved; remote ones are compared as written, normalised.
    """
    out: list[Destination] = []
    keys: list[tuple[str | None, PurePosixPath]] = []
    for dest in parsed:
        path = PurePosixPath(posixpath.normpath(dest.path))
        key = (dest.host, path)
        if key in keys:
            continue
        for (host, other), seen in zip(keys, out, strict=True):
            if host == dest.host and (path.is_relative_to(other) or other.is_relative_to(path)):
                raise MirrorError(
                    f"mirror destinations {seen.raw} and {dest.raw} are nested; refusing",
                    hint="give each worker its own directory",
                )
        keys.append(key)
        out.append(dest)
    return out


def _object_sha(path: str) -> str | None:
    """The sha of `objects/<aa>/<sha>.txt`, or None for anything else."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != "objects":
        return None
    return object_sha(parts[1], parts[2])


def _object_rel(sha: str) -> str:
    return f"objects/{sha[:2]}/{sha}.txt"


def _meta_sha(path: str) -> str | None:
    """The sha of `meta/<sha>.json`, or None for anything else."""
    parts = path.split("/")
    if len(parts) != 2 or parts[0] != "meta" or not parts[1].endswith(".json"):
        return None
    sha = parts[1].removesuffix(".json")
    return sha if is_full_sha(sha) else None


class _Verifier:
    """Re-hashes source objects before they travel; shared by all destinations of a run.

    Objects are immutable and content-addressed, so a path verified once in this run is
    not hashed again. An object removed at the source since the plan (a concurrent gc)
    is skipped: it is not returned, so it is not sent (the confirm pass sees the rest).
    """

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.count = 0
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, paths: Iterable[str]) -> list[str]:
        """The paths in `paths` that verified (vanished ones left out).

        Raises:
            IntegrityError: a path in objects/ that is not an object file (a symlink, a
                stray name), or an object whose bytes do not hash to its name.
        """
        ok = []
        for rel in paths:
            with self._lock:
                if rel in self._done:
                    ok.append(rel)
                    continue
            sha = _object_sha(rel)
            if sha is None:
                raise IntegrityError(
                    f"{self.reg.root / rel}: not an object file; refusing to mirror it",
                    path=self.reg.root / rel,
                )
            try:
                self.reg.read_verified(sha)
            except RefNotFoundError:
                continue  # removed at the source since the plan: it will not be sent
            with self._lock:
                if rel not in self._done:
                    self._done.add(rel)
                    self.count += 1
            ok.append(rel)
        return ok


def _top(path: str) -> str:
    return path.split("/", 1)[0]


def _objects_to_verify(changes: Iterable[Change]) -> list[str]:
    """Every object-path entry about to be sent that is not a directory.

    Not only regular files: a symlink (`cL`) or a device in objects/ must reach the
    verifier, which refuses it, instead of travelling unchecked.
    """
    return sorted({c.path for c in changes if c.is_object and not c.is_delete and not c.is_dir})


def _referenced_objects(reg: Registry, changes: Sequence[Change]) -> set[str]:
    """Objects the meta records and names in `changes` point to, read from the source now.

    A record removed at the source since the plan is skipped (it will not be sent), and
    so is a meta record whose object and record were both pruned meanwhile (gc removes the
    record first, so a record without its object is only ever seen mid-removal).

    Raises:
        IntegrityError: a name or meta path that is not a regular file (a symlink), a name
            that does not parse, or a name or meta record whose object is missing at the
            source (it could never arrive at the worker).
    """
    shas: set[str] = set()
    for c in changes:
        if c.is_delete or c.is_dir:
            continue
        parts = c.path.split("/")
        if parts[0] not in ("meta", "names") or len(parts) != 2:
            continue
        path = reg.root / c.path
        if not c.is_file:
            raise IntegrityError(f"{path}: not a regular file; refusing to mirror it", path=path)
        sha: str | None = None
        if parts[0] == "meta" and parts[1].endswith(".json"):
            sha = parts[1].removesuffix(".json")
            if not is_full_sha(sha):
                continue
        elif parts[0] == "names" and not fsutil.is_temp_name(parts[1]):
            try:
                raw = fsutil.read_nofollow(path, root=reg.root)
            except FileNotFoundError:
                continue  # removed since the plan: it will not be sent
            text = raw.decode("ascii", "replace")
            if not (len(raw) == 65 and raw.endswith(b"\n") and is_full_sha(text[:64])):
                raise IntegrityError(f"{path}: not a sha256 line; refusing", path=path)
            sha = text[:64]
        if sha is None:
            continue
        obj = reg.root / _object_rel(sha)
        # Object missing: look at the record again. Gone (gc pruned both) or changed (a
        # name moved): it is not what will be sent, so it needs nothing. Still there and
        # the object still missing: the source itself is broken.
        if not obj.exists() and _unchanged(path, reg.root, sha) and not obj.exists():
            raise IntegrityError(
                f"{path} points to {sha}, which is not in the registry; refusing", path=path
            )
        if obj.exists():
            shas.add(sha)
    return shas


def _unchanged(path: Path, root: Path, sha: str) -> bool:
    """True when the record at `path` still exists (and, for a name, still says `sha`)."""
    try:
        raw = fsutil.read_nofollow(path, root=root)
    except FileNotFoundError:
        return False
    return path.parent.name == "meta" or raw[:64].decode("ascii", "replace") == sha


# -- one destination ----------------------------------------------------------------------


class _Session:
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
        self.control: str | None = None
        self.rsh: list[str] | None = None
        self.ssh_options = list(ssh_options)
        self.plan: list[Change] = []
        self._started = time.monotonic()

    # ssh --------------------------------------------------------------------------------

    def open(self) -> None:
        """Start the shared ssh connection; this is where "cannot authenticate" surfaces."""
        if not self.dest.is_remote:
            return
        control = str(self.workdir / "cm")
        master = build_ssh_command(self.ssh_options, control_path=control)
        # ControlPersist bounds a leaked master (if we die) to a minute of idleness.
        master += ["-o", "ControlMaster=yes", "-o", "ControlPersist=60", "-N", "-f"]
        master.append(self.dest.ssh_host)
        err_path = self.workdir / "ssh-master.err"
        # stderr to a file, not a pipe: the backgrounded master keeps it open.
        with err_path.open("wb") as err:
            try:
                proc = subprocess.run(
                    master,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    check=False,
                    timeout=120,
                )
            except FileNotFoundError:
                raise MirrorError("ssh is not installed (not found on PATH)") from None
            except subprocess.TimeoutExpired:
                raise MirrorError(f"ssh to {self.dest.ssh_host} timed out") from None
        if proc.returncode != 0:
            message = first_error(err_path.read_text("utf-8", "replace"))
            raise MirrorError(f"ssh to {self.dest.ssh_host} failed: {message}")
        self.control = control
        client = build_ssh_command(self.ssh_options, control_path=control)
        self.rsh = [*client, "-o", "ControlMaster=no"]

    def close(self) -> None:
        if self.control is None:
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["ssh", "-o", f"ControlPath={self.control}", "-O", "exit", self.dest.ssh_host],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
                timeout=30,
            )
        self.control = None

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
        role, version = marker.get("role"), marker.get("version")
        if marker.get("format") != FORMAT or type(version) is not int or version > FORMAT_VERSION:
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
        marker = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "role": "mirror",
            "created": iso_utc(utc_now()),
        }
        (stage / MARKER).write_bytes(dumps_canonical(marker) + b"\n")
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

    def _pass(self, kind: str, paths: Sequence[str]) -> set[str]:
        """One `--files-from` step; returns the paths rsync itemized.

        For a send that is every listed path now at the destination (sent or already
        equal, thanks to `-ii`); for a delete, every path it deleted. Only real changes
        are recorded in `passes` and counted.
        """
        if not paths:
            return set()
        listing = self.workdir / f"{kind}.list"
        listing.write_bytes(b"".join(os.fsencode(p) + b"\0" for p in paths))
        mode: Mode = "delete" if kind.startswith("delete") else "send"
        argv = build_rsync_argv(
            mode,
            self.source,
            self.dest.target(),
            rsh=self.rsh,
            files_from=str(listing),
            bwlimit=self.bwlimit,
            checksum=self.full_verify,
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

    def apply(self, plan: Sequence[Change], verify: Callable[[Iterable[str]], list[str]]) -> None:
        """One round, in the order that keeps DESIGN §3's reader promise.

        1. objects (verified first; an object gc removed since the plan is left out);
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
        objects = [c.path for c in sends if c.is_object and c.is_dir]
        objects += verify(_objects_to_verify(sends))
        here = self._pass("objects", objects)

        meta = [c for c in sends if _top(c.path) == "meta"]
        names = [c for c in sends if _top(c.path) == "names"]
        rest = [c.path for c in sends if _top(c.path) not in ("objects", "meta", "names")]
        referenced: set[str] = set()
        done: set[str] = set()
        if meta:
            shas = _referenced_objects(self.reg, meta)
            referenced |= {_object_rel(sha) for sha in shas}
            here |= self._pass("meta-objects", verify(sorted(referenced - here)))
            ready = [
                c.path
                for c in meta
                if (sha := _meta_sha(c.path)) is None or _object_rel(sha) in here
            ]
            done |= self._pass("meta", ready)
        if names:
            with self.reg.lock("registry"):
                shas = _referenced_objects(self.reg, names)
                needed = sorted({_object_rel(sha) for sha in shas} - here)
                here |= self._pass("referenced-objects", verify(needed))
                missing = [rel for rel in needed if rel not in here]
                if missing:
                    raise MirrorError(
                        f"{self.dest.raw}: {missing[0]} did not arrive; names not sent"
                    )
                referenced |= {_object_rel(sha) for sha in shas}
                done |= self._pass("names", [c.path for c in names])
        self._pass("rest", rest)

        deletions = [c.path for c in plan if c.is_delete and not c.is_object]
        done |= self._pass("delete", deletions)
        records = {
            c.path for c in plan if _top(c.path) in ("meta", "names") and c.path != _top(c.path)
        }
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


# -- the use case ---------------------------------------------------------------------


def mirror(
    reg: Registry,
    destinations: Sequence[str],
    *,
    dry_run: bool = False,
    full_verify: bool = False,
    ssh_options: Sequence[str] = (),
    bwlimit: int | None = None,
    max_rounds: int = 3,
    on_result: Callable[[DestinationResult], None] | None = None,
) -> MirrorReport:
    """Mirror the origin registry `reg` to every destination (in parallel).

    Args:
        destinations: `PATH` or `[user@]host:PATH` strings (duplicates, after resolving
            local paths, are dropped; nested destinations are refused).
        dry_run: compare only; the report's `changes` say what would change.
        full_verify: re-hash every source object first, and compare with `--checksum`.
            Without it a destination is "verified" when an itemized dry run finds no
            size or mtime difference (the objects sent are still re-hashed first).
        ssh_options: `Key=Value` ssh options for remote destinations.
        bwlimit: rsync `--bwlimit` (KiB/s) for the transfer passes.
        max_rounds: how many apply + confirm rounds a changing origin may take.
        on_result: called with each destination's result as it finishes (progress lines).

    Returns:
        The report; a destination that failed has `ok` False (the others still ran).

    Raises:
        UsageError: no destination. MirrorError: a refused source or a malformed
        destination or option (nothing touched). IntegrityError: a source object about to
        be sent fails verification (nothing sent). LockTimeoutError: another mirror runs.
    """
    parsed = _dedupe([parse_destination(text) for text in destinations])
    if not parsed:
        raise UsageError(
            "no mirror destination", hint=f"pass --to HOST:PATH or PATH, or set {ENV_TO}"
        )
    options = parse_ssh_options(ssh_options)
    if shutil.which("rsync") is None:
        raise MirrorError("rsync is not installed (not found on PATH)", hint="install rsync")
    check_source(reg)
    for dest in parsed:
        _check_overlap(reg.root, dest)
    report = MirrorReport(source=str(reg.root), dry_run=dry_run, full_verify=full_verify)
    log_lock = threading.Lock()
    verifier = _Verifier(reg)

    def log(result: DestinationResult, *, announce: bool = True) -> None:
        if not dry_run:
            with log_lock:
                line = dumps_canonical(result.log_record(verifier.count))
                reg.append_mirror_log(line)
        if announce and on_result is not None:
            on_result(result)

    with reg.lock("mirror"), contextlib.ExitStack() as stack:
        sessions = []
        for dest in parsed:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="prxm-")))
            session = _Session(
                reg,
                dest,
                ssh_options=options,
                full_verify=full_verify,
                bwlimit=bwlimit,
                workdir=workdir,
            )
            stack.callback(session.close)
            sessions.append(session)
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=len(sessions)))

        # 1. Inspect and plan every destination; read-only everywhere.
        def plan(session: _Session) -> DestinationResult | None:
            try:
                session.open()
                session.inspect()
                session.plan = session.compare()
            except (MirrorError, OSError) as exc:
                return session.finish("failed", str(exc))
            return None

        planned = list(pool.map(plan, sessions))
        live = [s for s, failed in zip(sessions, planned, strict=True) if failed is None]

        # 2. Verify what is about to travel, for all destinations, before touching any.
        failed = [r for r in planned if r is not None]
        try:
            if full_verify:
                verifier(map(_object_rel, reg.iter_shas()))
            else:
                verifier(_objects_to_verify(c for s in live for c in s.plan))
            for s in live:
                _referenced_objects(reg, s.plan)
        except IntegrityError as exc:
            report.objects_verified = verifier.count
            for s in live:
                s.finish("refused", str(exc))
            for s in sessions:
                # Recorded, not announced: the raised error is the one line the user sees.
                log(s.result, announce=False)
            raise
        except OSError as exc:
            # An unreadable source file fails every destination (exit 6), with a log line.
            failed += [s.finish("failed", f"cannot read the source: {exc}") for s in live]
            live = []
        report.objects_verified = verifier.count
        for failed_result in failed:
            log(failed_result)

        if dry_run:
            for s in live:
                s.result.changes = list(s.plan)
                s.result.verified = not s.plan
                log(s.finish("dry-run"))
        else:

            def transfer(session: _Session) -> None:
                try:
                    _transfer(session, verifier, max_rounds)
                except (PrefixregError, OSError) as exc:
                    # One destination failing never stops the others; the log says why.
                    log(session.finish("failed", str(exc)))
                    return
                log(session.finish("ok"))

            list(pool.map(transfer, live))
            report.objects_verified = verifier.count
        report.results = [s.result for s in sessions]
    return report


def _transfer(session: _Session, verify: _Verifier, max_rounds: int) -> None:
    """Apply the plan and confirm, round after round, until the destination equals the source."""
    plan = session.plan
    if plan and session.result.new:
        session.write_marker()
    while plan:
        if session.result.rounds >= max_rounds:
            raise MirrorError(
                f"{session.dest.raw} still differs from the source after {max_rounds} rounds "
                f"({len(plan)} changes, e.g. {plan[0]}); is the origin being written to?"
            )
        session.result.rounds += 1
        session.apply(plan, verify)
        plan = session.compare()
        session.result.passes.append(PassRecord("confirm", plan))
    session.result.verified = True


def destinations_from_env(value: str | None) -> list[str]:
    """Destinations from `PREFIXREG_MIRROR_TO` (space-separated)."""
    return value.split() if value else []


def ssh_options_from_env(value: str | None) -> list[str]:
    """ssh options from `PREFIXREG_SSH_OPTS` (space-separated `Key=Value`)."""
    return value.split() if value else []

"""`prefixreg mirror`: one-way `rsync -a --delete` of an origin registry to its workers.

The mirror is provenance next to a worker, kept exact by a nightly job. `--delete` makes a
wrong source or destination catastrophic, so the guards are the feature:

- The source must be an origin registry (`REGISTRY.json` role `origin`) holding objects.
- A destination must be a local path or `[user@]host:path`, never start with `-`, and be
  missing, empty, or a mirror (its own `REGISTRY.json` says role `mirror`). An origin
  registry or a directory holding anything else is refused before anything is written.
- Every object about to be sent is re-hashed first (all of them with `full_verify`); one
  failure refuses the whole run and no destination is touched (`IntegrityError`, exit 3).

How a run goes, per destination (destinations run in parallel; one failing stops nothing):

1. compare: an itemized `rsync -a --delete --dry-run` (with `--checksum` under
   `full_verify`). Its output is the plan; when it is empty the destination already equals
   the source and that dry run *is* the confirmation, so a no-change run costs one pass.
2. apply the plan in an order that keeps the reader promise of DESIGN §3, each step a
   `--files-from` rsync of just the listed paths (cost grows with the change, not the tree):
   objects; then, under the registry lock (names only move under it), the objects every
   name and meta record about to be sent points to (usually none: they went in step 1),
   then meta, names and the other files; then deletions of non-objects; objects last.
   A reader on the worker therefore never sees a name or meta record whose object has
   not arrived, and nothing is deleted before everything new is in place.
3. confirm: the compare dry run again; it must list nothing. If the origin changed during
   the run it lists those changes and another round applies them (at most `max_rounds`).

`REGISTRY.json` never travels (the destination keeps its own, role `mirror`, written
before anything else), nor do `.locks/`, temp files or `mirror.log`; excluded paths are
also protected from deletion. Each destination's run appends one JSON line to the source's
`mirror.log`. rsync runs from an argv list (`build_rsync_argv`, pure) through one thin
runner; never a shell. Remote destinations share one ssh connection per run (an explicit
`ControlMaster`, which is also where an authentication failure is reported).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, NamedTuple

from prefixreg import fsutil
from prefixreg.digest import is_full_sha
from prefixreg.errors import (
    IntegrityError,
    MirrorError,
    PrefixregError,
    RegistryLocationError,
    UsageError,
)
from prefixreg.jsonio import dumps_canonical, loads_object
from prefixreg.store import FORMAT, FORMAT_VERSION, MARKER, Registry, iso_utc, utc_now

__all__ = [
    "EXCLUDES",
    "Change",
    "Destination",
    "DestinationResult",
    "MirrorReport",
    "PassRecord",
    "build_rsync_argv",
    "build_ssh_command",
    "mirror",
    "parse_destination",
    "parse_itemized",
    "parse_ssh_options",
    "run_rsync",
]

ENV_TO: Final = "PREFIXREG_MIRROR_TO"
ENV_SSH_OPTS: Final = "PREFIXREG_SSH_OPTS"
LOG_NAME: Final = "mirror.log"
# Anchored (leading /) where only the top level is meant. Excluded paths are also protected
# from --delete on the receiver, so the destination's own marker survives every pass.
EXCLUDES: Final = (f"/{MARKER}", f"/{LOG_NAME}", "/.locks/", ".*.tmp")
# One line per change: 11-char itemize code, bytes actually sent, path (last: may hold '|').
OUT_FORMAT: Final = "%i|%b|%n"
# Exit 24 = "some files vanished": a file removed at the origin between plan and send (the
# confirm pass catches what it means), and how --delete-missing-args reports its deletions.
_VANISHED: Final = 24
_RSYNC_ESCAPE = re.compile(rb"\\#([0-7]{3})")
_HOST_RE = re.compile(
    r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])"
)
# Remote paths go through the remote shell on old rsyncs: keep them to characters that
# need no quoting anywhere.
_REMOTE_PATH_RE = re.compile(r"[A-Za-z0-9._/~+@%,=:-]+")
_SSH_OPT_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*=\S.*")
_DEFAULT_SSH_OPTS: Final = ("ConnectTimeout=20", "ServerAliveInterval=15", "ServerAliveCountMax=4")


# -- destinations and options ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Destination:
    """A parsed destination: `host` is None for a local path (then `path` is absolute)."""

    raw: str
    host: str | None
    path: str

    @property
    def is_remote(self) -> bool:
        return self.host is not None

    @property
    def ssh_host(self) -> str:
        """The host as ssh wants it (IPv6 brackets are rsync's syntax, not ssh's)."""
        user, _, name = (self.host or "").rpartition("@")
        name = name.removeprefix("[").removesuffix("]")
        return f"{user}@{name}" if user else name

    def target(self, sub: str = "") -> str:
        """The rsync operand for the destination directory (with `/`) or a path in it."""
        base = self.path.rstrip("/") or "/"
        joined = f"{base}/{sub}" if base != "/" else f"/{sub}"
        return f"{self.host}:{joined}" if self.host is not None else joined


def parse_destination(text: str) -> Destination:
    """Parse `PATH` or `[user@]host:PATH` the way rsync reads an operand.

    Raises:
        MirrorError: empty, starts with `-`, an rsync daemon or URL form, a bad host, an
            empty remote path (that would be the remote home directory), control characters.
    """
    if not text:
        raise MirrorError("empty mirror destination")
    if text.startswith("-"):
        raise MirrorError(f"mirror destination {text!r} starts with '-'; refusing")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise MirrorError(f"mirror destination {text!r} contains control characters")
    if text.startswith("rsync://"):
        raise MirrorError(f"{text!r}: rsync daemon destinations are not supported; use host:path")
    head, colon, rest = text.partition(":")
    if text.startswith("[") and "]:" in text:  # [v6addr]:path
        head, _, rest = text.partition("]:")
        head, colon = head + "]", ":"
    if colon and "/" not in head:
        if rest.startswith(":"):
            raise MirrorError(f"{text!r}: rsync daemon destinations are not supported")
        if not head or _HOST_RE.fullmatch(head) is None or head.startswith("-"):
            raise MirrorError(f"mirror destination {text!r}: {head!r} is not a host name")
        if not rest:
            raise MirrorError(
                f"mirror destination {text!r} has no path after ':'; refusing to mirror "
                "into a remote home directory"
            )
        if rest.startswith("-"):
            raise MirrorError(f"mirror destination {text!r}: path starts with '-'; refusing")
        if _REMOTE_PATH_RE.fullmatch(rest) is None:
            raise MirrorError(
                f"mirror destination {text!r}: remote paths may only use letters, digits and "
                "._/~+@%,=:-"
            )
        return Destination(raw=text, host=head, path=rest)
    return Destination(raw=text, host=None, path=str(Path(text).resolve()))


def parse_ssh_options(values: Sequence[str]) -> list[str]:
    """Validate `Key=Value` ssh options (each becomes `-o Key=Value`).

    Raises:
        MirrorError: not `Key=Value`, or a quote character (the `-e` string is split by rsync).
    """
    out = []
    for value in values:
        if _SSH_OPT_RE.fullmatch(value) is None:
            raise MirrorError(f"ssh option {value!r} is not Key=Value (e.g. Port=2222)")
        if any(c in value for c in "'\"\\\n"):
            raise MirrorError(f"ssh option {value!r}: quotes and backslashes are not supported")
        out.append(value)
    return out


def build_ssh_command(options: Sequence[str], *, control_path: str | None) -> list[str]:
    """The ssh argv (without host) rsync and the control master use.

    BatchMode comes first because ssh keeps the first value it sees: nothing may turn a
    nightly job into a password prompt. User options come next so they override our
    defaults (timeouts, keep-alives); the control socket options come last.
    """
    argv = ["ssh", "-o", "BatchMode=yes"]
    for opt in [*options, *_DEFAULT_SSH_OPTS]:
        argv += ["-o", opt]
    if control_path is not None:
        argv += ["-o", f"ControlPath={control_path}"]
    return argv


def _rsh_string(argv: Sequence[str]) -> str:
    """Join an ssh argv into the `-e` string rsync splits itself (whitespace, 'quotes')."""
    return " ".join(f"'{a}'" if any(c.isspace() for c in a) or not a else a for a in argv)


Mode = Literal["compare", "send", "delete", "list", "fetch", "marker"]


def build_rsync_argv(
    mode: Mode,
    source: str,
    dest: str,
    *,
    rsh: Sequence[str] | None = None,
    checksum: bool = False,
    files_from: str | None = None,
    bwlimit: int | None = None,
) -> list[str]:
    """The rsync argv for one step of a mirror run (pure: no I/O).

    Modes:
        compare: itemized `-a --delete` dry run of the whole tree (the plan and the check).
        send: `-a` of the NUL-separated paths in `files_from` (no recursion, no deletion).
        delete: delete the `files_from` paths that no longer exist at the source.
        list: `--list-only` of the top level of `source` (the destination, for inspection).
        fetch: copy one regular file (the destination's marker) to a local path.
        marker: copy the staged marker directory to a new destination.

    `-O` (omit directory times) everywhere: directory mtimes mean nothing in a registry
    and would otherwise show up as differences after every targeted pass.
    """
    argv = ["rsync"]
    if rsh is not None:
        argv += ["-e", _rsh_string(rsh)]
    if mode == "list":
        return [*argv, "--list-only", "--dirs", "--", source]
    if mode == "fetch":
        # No -l/-L: a symlinked marker is skipped, never followed.
        return [*argv, "--", source, dest]
    if mode == "marker":
        return [*argv, "-a", "-O", "--", source, dest]
    # --modify-window=-1: compare mtimes to the nanosecond. The default compares whole
    # seconds, and a name is always 65 bytes: a name moved within the second of the last
    # mirror would look unchanged to the quick check and never travel.
    argv += ["-a", "-O", "--modify-window=-1", f"--out-format={OUT_FORMAT}"]
    argv += [f"--exclude={pattern}" for pattern in EXCLUDES]
    if bwlimit is not None:
        argv.append(f"--bwlimit={int(bwlimit)}")
    if checksum:
        # The compare found a difference the quick check (size + mtime) cannot see; the
        # send must look at content too, or it would skip the very file it was told about.
        argv.append("--checksum")
    if mode == "compare":
        argv += ["--delete", "--dry-run"]
    else:
        if files_from is None:
            raise ValueError(f"mode {mode} needs files_from")
        # --force: a directory where the source has a file is replaced, not an error.
        argv += [f"--files-from={files_from}", "--from0", "--force"]
        if mode == "delete":
            argv.append("--delete-missing-args")
    return [*argv, "--", source, dest]


class RsyncRun(NamedTuple):
    returncode: int
    stdout: bytes
    stderr: str


def run_rsync(argv: Sequence[str], *, ok_codes: Sequence[int] = (0,)) -> RsyncRun:
    """Run rsync (argv list, never a shell); a return code not in `ok_codes` is `MirrorError`."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, check=False)
    except FileNotFoundError:
        raise MirrorError(
            "rsync is not installed (not found on PATH)", hint="install the rsync package"
        ) from None
    stderr = proc.stderr.decode("utf-8", "replace")
    if proc.returncode not in ok_codes:
        raise MirrorError(
            f"rsync failed (exit {proc.returncode}): {_first_error(stderr)}",
            returncode=proc.returncode,
            stderr=stderr,
        )
    return RsyncRun(proc.returncode, proc.stdout, stderr)


def _first_error(stderr: str) -> str:
    """The most telling line of rsync/ssh stderr, for a one-line error."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in lines:
        if not ln.startswith("rsync error:") and "write error: Broken pipe" not in ln:
            return ln
    return lines[0] if lines else "no message"


# -- itemized output -------------------------------------------------------------------


class Change(NamedTuple):
    """One itemized line: rsync's 11-character code, bytes sent, the relative path."""

    code: str
    bytes: int
    path: str

    @property
    def is_delete(self) -> bool:
        return self.code.startswith("*deleting")

    @property
    def is_file(self) -> bool:
        return self.code[1] == "f"

    @property
    def is_object(self) -> bool:
        return self.path == "objects" or self.path.startswith("objects/")

    def __str__(self) -> str:
        return f"{self.code} {self.path}"


def parse_itemized(stdout: bytes) -> list[Change]:
    """Parse `--out-format=%i|%b|%n` output; other lines ("created directory") are skipped.

    rsync escapes unprintable bytes in names as `\\#ooo`; they are restored, so a path can
    be handed back to rsync (in a NUL-separated `--files-from`) exactly.
    """
    out = []
    for line in stdout.split(b"\n"):
        if len(line) < 13 or line[11:12] != b"|":
            continue
        code = line[:11].decode("ascii", "replace")
        size, sep, raw = line[12:].partition(b"|")
        if not sep or not size.isdigit():
            continue
        raw = _RSYNC_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), raw)
        path = os.fsdecode(raw).rstrip("/") or "."
        if path.startswith("./") and path != "./":
            path = path[2:]
        out.append(Change(code=code, bytes=int(size), path=path))
    return out


# -- results ------------------------------------------------------------------------------


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
    if dest.is_remote:
        return
    src = os.path.realpath(source)
    dst = os.path.realpath(dest.path)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
        raise MirrorError(f"destination {dest.raw} overlaps the source {source}; refusing")


def _object_sha(path: str) -> str | None:
    """The sha of `objects/<aa>/<sha>.txt`, or None for anything else."""
    parts = path.split("/")
    if len(parts) != 3 or parts[0] != "objects" or not parts[2].endswith(".txt"):
        return None
    sha = parts[2].removesuffix(".txt")
    return sha if is_full_sha(sha) and sha[:2] == parts[1] else None


def _object_rel(sha: str) -> str:
    return f"objects/{sha[:2]}/{sha}.txt"


def _verify_objects(reg: Registry, paths: Iterator[str] | Sequence[str]) -> int:
    """Re-hash every object file in `paths`; anything in objects/ that is not one is refused."""
    count = 0
    for rel in paths:
        sha = _object_sha(rel)
        if sha is None:
            raise IntegrityError(
                f"{reg.root / rel}: not an object file; refusing to mirror it", path=reg.root / rel
            )
        reg._read_verified(sha)
        count += 1
    return count


def _referenced_objects(reg: Registry, changes: Sequence[Change]) -> set[str]:
    """Objects the meta records and names in `changes` point to, read from the source now.

    Raises:
        IntegrityError: a name that does not parse, or a name or meta record whose object
            is missing at the source (it could never arrive at the worker).
    """
    shas: set[str] = set()
    for c in changes:
        if c.is_delete or not c.is_file:
            continue
        parts = c.path.split("/")
        if len(parts) != 2:
            continue
        sha: str | None = None
        if parts[0] == "meta" and parts[1].endswith(".json"):
            sha = parts[1].removesuffix(".json")
            if not is_full_sha(sha):
                continue
        elif parts[0] == "names" and not fsutil.is_temp_name(parts[1]):
            try:
                raw = fsutil.read_nofollow(reg.root / c.path)
            except FileNotFoundError:
                continue  # removed since the plan: it will not be sent
            text = raw.decode("ascii", "replace")
            if not (len(raw) == 65 and raw.endswith(b"\n") and is_full_sha(text[:64])):
                raise IntegrityError(f"{reg.root / c.path}: not a sha256 line; refusing")
            sha = text[:64]
        if sha is None:
            continue
        if not (reg.root / _object_rel(sha)).exists():
            raise IntegrityError(
                f"{reg.root / c.path} points to {sha}, which is not in the registry; refusing",
                path=reg.root / c.path,
            )
        shas.add(sha)
    return shas


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
            message = _first_error(err_path.read_text("utf-8", "replace"))
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
        entries: dict[str, str] = {}
        for line in listing.stdout.decode("utf-8", "replace").splitlines():
            m = re.match(r"(\S{10})\s+[\d,]+ \S+ \S+ (.*)$", line)
            if m is not None and m.group(2) != ".":
                entries[m.group(2)] = m.group(1)
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
        return parse_itemized(run_rsync(argv).stdout)

    def _pass(self, kind: str, paths: Sequence[str]) -> list[Change]:
        if not paths:
            return []
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
        changes = parse_itemized(run_rsync(argv, ok_codes=(0, _VANISHED)).stdout)
        self.result.passes.append(PassRecord(kind, changes))
        for c in changes:
            if c.is_delete:
                self.result.deleted += 1
            elif c.is_file:
                self.result.sent += 1
                self.result.bytes += c.bytes
        return changes

    def apply(self, plan: Sequence[Change], verify: Callable[[Sequence[str]], int]) -> None:
        """One round: objects, referenced objects + the rest (under lock), deletions."""
        objects = [c.path for c in plan if not c.is_delete and c.is_object]
        rest = [c for c in plan if not c.is_delete and not c.is_object]
        self._pass("objects", objects)
        if rest:
            # Names move only under the registry lock: holding it, the names read here are
            # the names sent, so every object they point to is sent first.
            with self.reg.lock("registry"):
                sent = set(objects)
                needed = sorted(
                    rel
                    for rel in map(_object_rel, _referenced_objects(self.reg, rest))
                    if rel not in sent
                )
                verify(needed)
                self._pass("referenced-objects", needed)
                self._pass("rest", [c.path for c in rest])
        self._pass("delete", [c.path for c in plan if c.is_delete and not c.is_object])
        self._pass("delete-objects", [c.path for c in plan if c.is_delete and c.is_object])

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
        destinations: `PATH` or `[user@]host:PATH` strings (duplicates are dropped).
        dry_run: compare only; the report's `changes` say what would change.
        full_verify: re-hash every source object first, and compare with `--checksum`.
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
    parsed: list[Destination] = []
    for text in destinations:
        dest = parse_destination(text)
        if dest not in parsed:
            parsed.append(dest)
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

    def log(result: DestinationResult, *, announce: bool = True) -> None:
        if not dry_run:
            with log_lock:
                line = dumps_canonical(result.log_record(report.objects_verified))
                fsutil.append_line(reg.root / LOG_NAME, line)
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
        try:
            if full_verify:
                report.objects_verified = _verify_objects(reg, map(_object_rel, reg.iter_shas()))
            else:
                to_send = {
                    c.path
                    for s in live
                    for c in s.plan
                    if c.is_object and c.is_file and not c.is_delete
                }
                report.objects_verified = _verify_objects(reg, sorted(to_send))
            for s in live:
                _referenced_objects(reg, s.plan)
        except IntegrityError as exc:
            for s in live:
                s.finish("refused", str(exc))
            for s in sessions:
                # Recorded, not announced: the raised error is the one line the user sees.
                log(s.result, announce=False)
            raise
        for failed_result in planned:
            if failed_result is not None:
                log(failed_result)

        if dry_run:
            for s in live:
                s.result.changes = list(s.plan)
                s.result.verified = not s.plan
                log(s.finish("dry-run"))
        else:
            verified_lock = threading.Lock()

            def verify(paths: Sequence[str]) -> int:
                count = _verify_objects(reg, paths)
                with verified_lock:
                    report.objects_verified += count
                return count

            def transfer(session: _Session) -> None:
                try:
                    _transfer(session, verify, max_rounds)
                except (PrefixregError, OSError) as exc:
                    # One destination failing never stops the others; the log says why.
                    log(session.finish("failed", str(exc)))
                    return
                log(session.finish("ok"))

            list(pool.map(transfer, live))
        report.results = [s.result for s in sessions]
    return report


def _transfer(session: _Session, verify: Callable[[Sequence[str]], int], max_rounds: int) -> None:
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
        if session.result.rounds > 1:
            verify([c.path for c in plan if c.is_object and c.is_file and not c.is_delete])
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

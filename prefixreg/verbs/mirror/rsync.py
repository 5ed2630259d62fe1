"""The transport of the mirror: destinations, ssh options, argv builders, the runner, parsers.

Everything here but `run` is pure; `run` is the one runner (an argv list, never a local
shell, the C locale so messages and listing formats are stable).
"""

from __future__ import annotations

import os
import posixpath
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, NamedTuple

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import MirrorError, UsageError
from prefixreg.registry import layout
from prefixreg.registry.layout import LOCKS, MARKER, MIRROR_LOG, OBJECTS, TMP_SUFFIX

# Anchored (leading /) where only the top level is meant. Excluded paths are also protected
# from --delete on the receiver, so the destination's own marker survives every pass.
EXCLUDES: Final = (f"/{MARKER}", f"/{MIRROR_LOG}", f"/{LOCKS}/", f".*{TMP_SUFFIX}")
# Exit 24 = "some files vanished": a file removed at the origin (a gc) while rsync walked
# it; the confirm pass catches what it means, so it is no failure of the compare or a pass.
VANISHED: Final = 24
# The far side's hasher: every regular `*.txt` file below the start directories (find never
# follows a link), its path (-print) and its sha256; a path without a hash was unreadable.
_HASH_SCRIPT: Final = (
    "cd -- {path} || exit 2; command -v find >/dev/null 2>&1 && command -v sha256sum "
    '>/dev/null 2>&1 || {{ echo "find or sha256sum is not installed" >&2; exit 127; }}; '
    'find {starts} -type f -name "*.txt" -print -exec sha256sum -- {{}} + 2>/dev/null; exit 0'
)
_ESCAPE = re.compile(rb"\\#([0-7]{3})")
# `host:path`, `user@host:path`, `[v6]:path`, `user@[v6]:path` (the colons inside the
# brackets are the address's); no `/` before the first colon, as rsync reads it.
_REMOTE_RE = re.compile(r"((?:[^@/\[\]:]+@)?\[[^\]/]*\]|[^/:]*):(.*)")
_HOST_RE = re.compile(
    r"(?:[A-Za-z0-9_][A-Za-z0-9._-]*@)?(?:[A-Za-z0-9][A-Za-z0-9.-]*|\[[0-9A-Fa-f:.]+\])"
)
# Remote paths go through the remote shell (rsync's and the hasher's): keep them to
# characters that need no quoting anywhere.
_REMOTE_PATH_RE = re.compile(r"[A-Za-z0-9._/~+@%,=:-]+")
# One `--list-only` line in the C locale: mode, size (grouped with , or .), date, time, name.
LIST_LINE_RE = re.compile(r"(\S{10})\s+[\d,.]+ \S+ \S+ (.+)")
_SSH_OPT_RE = re.compile(r"[A-Za-z][A-Za-z0-9]*=\S.*")
_DEFAULT_SSH_OPTS: Final = ("ConnectTimeout=20", "ServerAliveInterval=15", "ServerAliveCountMax=4")
# One connection per run, opened by its first command (BatchMode: a failed login is that
# command's one-line error); ControlPersist ends one a killed run leaked after a minute.
_SHARED: Final = ("ControlMaster=auto", "ControlPersist=60")


@dataclass(frozen=True, slots=True)
class Destination:
    """A parsed destination: `host` is None for a local path (then `path` is absolute)."""

    raw: str
    host: str | None
    path: str

    @property
    def ssh_host(self) -> str:
        """The host as ssh wants it (IPv6 brackets are rsync's syntax, not ssh's)."""
        user, at, name = (self.host or "").rpartition("@")
        return f"{user}{at}{name.strip('[]')}"

    @property
    def parent(self) -> Destination:
        """The directory the destination is created in (a relative remote one: `.`)."""
        return Destination(self.raw, self.host, posixpath.dirname(self.path.rstrip("/")) or ".")

    def target(self, sub: str = "") -> str:
        """The rsync operand for the destination directory (with `/`) or a path in it."""
        base = self.path.rstrip("/")
        return f"{self.host}:{base}/{sub}" if self.host is not None else f"{base}/{sub}"


def parse_destination(text: str) -> Destination:
    """Parse `PATH` or `[user@]host:PATH` the way rsync reads an operand; a local path is
    made absolute and resolved (so `/m`, `/m/` and `/x/../m` are one destination).

    Raises:
        MirrorError: `text` is no destination (`_problem` says why).
    """
    remote = _REMOTE_RE.fullmatch(text)
    if (problem := _problem(text, remote)) is not None:
        hint = "give a directory of its own, e.g. host:prefix-mirror or host:/srv/prefix-mirror"
        raise MirrorError(f"mirror destination {text!r} {problem}; refusing", hint=hint)
    if remote is None:
        return Destination(raw=text, host=None, path=str(Path(text).resolve()))
    return Destination(text, remote.group(1), remote.group(2))


def _problem(text: str, remote: re.Match[str] | None) -> str | None:
    """Why `text` is no destination, or None. A relative remote path is resolved against the
    remote home directory: empty, `.`, `~`, `~user` and `a/..` name it (--delete empties it)."""
    host, path = remote.groups() if remote is not None else ("", "")
    norm, far = posixpath.normpath(path or "."), remote is not None
    home = (norm.startswith("~") and "/" not in norm) or set(norm.split("/")) <= {".", ".."}
    problems = {
        "is empty": not text,
        "contains control characters": any(ord(c) < 32 or ord(c) == 127 for c in text),
        "starts with '-'": text.startswith("-") or path.startswith("-"),
        "is an rsync daemon destination": text.startswith("rsync://") or path[:1] == ":",
        f"has {host!r}, not a host name": far and not _HOST_RE.fullmatch(host),
        "has no path after ':' (the remote home directory)": far and not path,
        "uses what remote paths may not (only letters, digits, ._/~+@%,=:-)": far
        and not _REMOTE_PATH_RE.fullmatch(path),
        "names a remote home directory (or its parent, or /)": far
        and (home or norm in ("/", "//")),
    }
    return next((why for why, bad in problems.items() if bad), None)


def parse_ssh_options(values: Sequence[str]) -> list[str]:
    """Validate `Key=Value` ssh options (each becomes `-o Key=Value`); `UsageError` (a bad
    argument, exit 2) for another form, or a quote character (rsync splits the `-e` string)."""
    for value in values:
        if _SSH_OPT_RE.fullmatch(value) is None:
            raise UsageError(f"ssh option {value!r} is not Key=Value (e.g. Port=2222)")
        if any(c in value for c in "'\"\\\n"):
            raise UsageError(f"ssh option {value!r}: quotes and backslashes are not supported")
    return list(values)


def build_ssh_command(options: Sequence[str], *, control_path: str | None) -> list[str]:
    """The ssh argv (without host) of every command. BatchMode first (ssh keeps the first
    value it sees: nothing may turn a nightly job into a password prompt), then the user's
    options (overriding our timeouts and keep-alives), then the control socket."""
    control = () if control_path is None else (f"ControlPath={control_path}", *_SHARED)
    opts = ["BatchMode=yes", *options, *_DEFAULT_SSH_OPTS, *control]
    return ["ssh", *(arg for opt in opts for arg in ("-o", opt))]


Mode = Literal[
    "compare-objects", "compare-records", "send", "delete", "list", "fetch", "marker", "file"
]


def build_rsync_argv(
    mode: Mode,
    source: str,
    dest: str,
    *,
    rsh: Sequence[str] | None = None,
    files_from: str | None = None,
    bwlimit: int | None = None,
    regular_only: bool = False,
) -> list[str]:
    """The rsync argv for one step of a mirror run (pure). Modes: `compare-objects` and
    `compare-records`, itemized `-a --delete` dry runs of `objects/` by size and mtime (their
    bytes are hashed at the destination: `hash_argv`) and of the rest by content; `send` and
    `delete` of the NUL-separated paths in `files_from` (see below); `list` (the top level),
    `fetch` (the marker, to a local path; no -l: a symlink is skipped, never followed) and
    `marker` (the staged marker of a new destination), `file` (one snapshot file, either
    way; like `fetch`, never a symlink). `-O` (omit directory times) everywhere: directory
    mtimes mean nothing in a registry and would differ after every pass.
    """
    argv = ["rsync"]
    if rsh is not None:  # rsync splits the -e string itself, at whitespace outside quotes
        argv += ["-e", " ".join(f"'{a}'" if any(c.isspace() for c in a) else a for a in rsh)]
    if mode in ("list", "fetch", "marker", "file"):
        flags = {"list": ["--list-only", "--dirs"], "marker": ["-a", "-O"]}.get(mode, [])
        return [*argv, *flags, "--", source] + ([] if mode == "list" else [dest])
    # --modify-window=-1: compare mtimes to the nanosecond. The default compares whole
    # seconds, and a name is always 65 bytes: a name moved within the second of the last
    # mirror would look unchanged to the quick check and never travel. The out-format is
    # the itemize code, the bytes sent and the path (last: it may hold a '|').
    argv += ["-a", "-O", "--modify-window=-1", "--out-format=%i|%b|%n"]
    argv += [f"--exclude={pattern}" for pattern in EXCLUDES]
    if bwlimit is not None:
        argv.append(f"--bwlimit={int(bwlimit)}")
    if mode == "compare-objects":
        argv += [f"--include=/{OBJECTS}/***", "--exclude=*", "--delete", "--dry-run"]
    elif mode == "compare-records":
        argv += ["--checksum", f"--exclude=/{OBJECTS}/", "--delete", "--dry-run"]
    elif files_from is None:
        raise ValueError(f"mode {mode} needs files_from")
    elif mode == "delete":
        # --delete-missing-args alone would *send* a path that came back at the source
        # since the plan (a name could then arrive before its object). With --existing
        # (create nothing new) and --ignore-existing (update nothing there) rsync only
        # deletes what is still missing at the source, and never sends anything.
        argv += [f"--files-from={files_from}", "--from0", "--force", "--delete-missing-args"]
        argv += ["--existing", "--ignore-existing"]
    else:
        # --checksum: a file changed in place keeps its size and mtime. A listed path
        # removed at the source since the plan (gc) is skipped; -ii names every listed path
        # now at the destination (sent or already equal); --force replaces a directory where
        # a file belongs; never a symlink, device or FIFO; with `regular_only` no directory
        # either (--files-from implies --dirs; parents are still created).
        argv += [f"--files-from={files_from}", "--from0", "--force", "--checksum"]
        argv += ["--ignore-missing-args", "-ii", "--no-links", "--no-devices", "--no-specials"]
        argv += ["--no-dirs"] if regular_only else []
    return [*argv, "--", source, dest]


def hash_argv(
    dest: Destination, rsh: Sequence[str] | None, objects: Sequence[str] = ()
) -> list[str]:
    """The argv that hashes, at the destination, every object file there (or, given object
    paths, every one in their fan directories): over the run's ssh connection, or `sh`."""
    if any(layout.object_sha(p) is None for p in objects):  # they go into a shell command
        raise ValueError(f"not object paths: {objects}")
    starts = " ".join(sorted({posixpath.dirname(p) for p in objects})) or OBJECTS
    script = _HASH_SCRIPT.format(path='"$1"' if dest.host is None else dest.path, starts=starts)
    if dest.host is None:
        return ["sh", "-c", script, "sh", dest.path]
    # One argument for the remote login shell, whatever it is; the path needs no quoting.
    return [*(rsh or ()), dest.ssh_host, f"sh -c '{script}'"]


def check_hashes(stdout: bytes) -> dict[str, str | None]:
    """{object path the hasher listed: None when its bytes hash to its name, else what is
    wrong ("hashes to <sha>", "cannot be read", "hashed twice")}; other paths do not count
    (a stray name, or one sha256sum escaped: that line starts with a backslash)."""
    found: dict[str, str | None] = {}
    listed = []
    for line in stdout.decode("ascii", "replace").split("\n"):
        digest, rel = line[:64], line[66:]
        if line[64:66] not in ("  ", " *"):  # " *": sha256sum's binary mode
            listed.append(line)
        elif rel in found:
            found[rel] = "hashed twice"
        elif is_full_sha(digest) and rel == layout.object_relpath(digest):
            found[rel] = None  # the fast path: the path is the one its bytes' sha names
        elif layout.object_sha(rel) is not None:
            found[rel] = f"hashes to {digest}"
    found |= {
        rel: "cannot be read" for rel in listed if rel not in found and layout.object_sha(rel)
    }
    return found


def run(argv: Sequence[str], *, ok_codes: Sequence[int] = (0,)) -> bytes:
    """The stdout of rsync, ssh or sh (an argv list) run in the C locale, whose messages and
    listing format are matched here (and names come back `\\#ooo`-escaped).

    Raises:
        MirrorError: the program is missing, or exits with a code not in `ok_codes` (with it).
    """
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
    try:
        proc = subprocess.run(list(argv), capture_output=True, check=False, env=env)
    except FileNotFoundError:
        raise MirrorError(f"{argv[0]} is not installed (not found on PATH)") from None
    if proc.returncode not in ok_codes:
        stderr = proc.stderr.decode("utf-8", "replace")
        message = f"{argv[0]} failed (exit {proc.returncode}): {first_error(stderr)}"
        raise MirrorError(message, returncode=proc.returncode, stderr=stderr)
    return proc.stdout


def first_error(stderr: str) -> str:
    """The most telling line of rsync/ssh stderr, for a one-line error."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    telling = [ln for ln in lines if not ln.startswith("rsync error:") and "Broken pipe" not in ln]
    return (telling or lines or ["no message"])[0]


_KINDS: Final = {"f": "file", "d": "dir", "L": "symlink", "D": "device", "S": "special"}


class Change(NamedTuple):
    """One itemized line: rsync's 11-character code, bytes sent, the relative path. `kind`
    is what it is at the sender; `is_unchanged`, an `-ii` line for a path already equal."""

    code: str
    bytes: int
    path: str

    @property
    def is_delete(self) -> bool:
        return self.code.startswith("*deleting")

    @property
    def kind(self) -> str:
        return _KINDS.get(self.code[1], "unknown")

    @property
    def is_unchanged(self) -> bool:
        return self.code[0] == "." and not self.code[2:].strip(" .")

    @property
    def is_object(self) -> bool:
        return self.path.split("/", 1)[0] == OBJECTS

    def __str__(self) -> str:
        return f"{self.code} {self.path}"


def parse_itemized(stdout: bytes) -> list[Change]:
    """Parse `--out-format=%i|%b|%n` output (other lines are skipped), restoring the bytes
    rsync escapes as `\\#ooo`, so a path goes back to rsync (`--files-from`) exactly."""
    out = []
    for line in stdout.split(b"\n"):
        size, sep, raw = line[12:].partition(b"|")
        if len(line) < 13 or line[11:12] != b"|" or not sep or not size.isdigit():
            continue
        path = os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), raw))
        path = path.rstrip("/") or "."
        path = path[2:] if path.startswith("./") else path
        out.append(Change(code=line[:11].decode("ascii", "replace"), bytes=int(size), path=path))
    return out

"""The files a user names on the command line or to the API: prefix, tools, corpus, session
and pool files to read, metrics and HTML files to write. None of them is a registry path.

Invariants:
- A file a user names is read only if it is a regular file (checked before the open and again
  on the descriptor: a FIFO never blocks, a directory is refused), and only up to a size cap.
- One they name for output replaces only a regular file (or a symlink: the link, not its
  target); a directory, FIFO, device or socket there is refused before any work is done.
- No output a user names lands inside a registry root (`check_output_file`, the one rule for
  every such path): resolved through symlinks, against the registry in use, every registry
  this process opened and any registry directory above it, before any work is done.
- A file whose lines are sent on with the user's key (a keeper's `--session`) is used only if
  no other local user could have written it (`refuse_shared`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, UsageError
from prefixreg.registry.fsutil import read_fd
from prefixreg.registry.layout import MARKER, META, NAMES, OBJECTS
from prefixreg.registry.location import resolve_registry_path

MAX_INPUT_BYTES: Final = 64 << 20  # a user's prefix, tools or corpus file: far above any context
_READ: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # a planted FIFO must not hang the open
_SEEN: dict[str, None] = {}  # resolved roots of the registries this process opened, in order
_SEEN_MAX: Final = 64


def open_user_file(path: Path | str) -> tuple[int, os.stat_result]:
    """A descriptor of a file a user named (the caller closes it, or `read_fd` does) and its
    status read from that descriptor, so the checks and the reads see one file. Refused
    before the open and again on the descriptor unless a regular file. Raises:
    FileNotFoundError; UsageError (not a regular file, or unreadable)."""
    try:
        if not stat.S_ISREG(mode := Path(path).stat().st_mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise UsageError(f"{path}: {kind}; refused")
        fd = os.open(path, _READ)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped for another kind since the look
        os.close(fd)
        raise UsageError(f"{path}: not a regular file; refused")
    return fd, st


def read_user_file(path: Path | str, *, limit: int = MAX_INPUT_BYTES, offset: int = 0) -> bytes:
    """A file a user named (`-`: stdin; a symlink they name is theirs to follow), from
    `offset` on, refused unless a regular file (`open_user_file`). Raises: UsageError
    (missing, unreadable, not a regular file, or more than `limit` bytes to read)."""
    try:
        if os.fspath(path) == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            data = read_open(open_user_file(path)[0], path, offset=offset, limit=limit)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UsageError(f"{path}: larger than {limit:,} bytes; refused")
    return data


def read_open(fd: int, path: Path | str, *, offset: int = 0, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of an open user file (`open_user_file`; the descriptor is closed here) from
    `offset`, at most `limit` + 1 of them."""
    try:
        os.lseek(fd, offset, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    try:
        return read_fd(fd, path, limit)[0]
    except IntegrityError:
        raise UsageError(f"{path}: not a regular file; refused") from None


def note_registry(root: Path | str) -> None:
    """Remember `root` as a registry this process uses (`Registry()` calls it; so does the
    CLI's `--registry`): `check_output_file` refuses any output inside it, made yet or not."""
    try:
        real = os.path.realpath(root)
    except (OSError, ValueError):  # a NUL in it: no such directory to protect
        return
    _SEEN.pop(real, None)
    _SEEN[real] = None
    while len(_SEEN) > _SEEN_MAX:  # a long-lived process opening many: the recent ones
        del _SEEN[next(iter(_SEEN))]


def is_registry_dir(path: Path | str) -> bool:
    """True when `path` is a registry root: it holds `REGISTRY.json`, or it is laid out as a
    hand-built one (`objects/` beside `names/` or `meta/`, what `migrate --repoint` adopts)."""
    p = Path(path)
    if os.path.lexists(p / MARKER):
        return True
    return (p / OBJECTS).is_dir() and ((p / NAMES).is_dir() or (p / META).is_dir())


def registry_holding(path: Path | str, *, registry: Path | str | None = None) -> Path | None:
    """The registry root `path` would land in, or None. Resolved through every symlink (the
    path's own too, whose target a follower would write, and its directories): the registry
    in use (`registry`, else `$PREFIXREG_HOME`, else the default), any this process opened,
    and any directory above the resolved path (or the path itself) that is a registry."""
    given = Path(path).expanduser().absolute()
    # Where the name sits (a replacer writes the link itself) and where a follower writes.
    spots = {Path(os.path.realpath(given))}
    if given.name not in ("", ".", ".."):
        spots.add(Path(os.path.realpath(given.parent)) / given.name)
    roots = [Path(r) for r in _SEEN]
    with contextlib.suppress(OSError, ValueError):
        roots.append(Path(os.path.realpath(resolve_registry_path(registry))))
    for spot in spots:
        for root in roots:
            if spot == root or spot.is_relative_to(root):
                return root
        for above in (spot, *spot.parents):
            if is_registry_dir(above):
                return above
    return None


def check_output_file(
    path: Path | str,
    what: str,
    *,
    registry: Path | str | None = None,
    directory: bool = False,
    parents: bool = False,
) -> Path:
    """`path` (as a Path) if a user's output may be written there: never inside a registry
    root (`registry_holding`: a metrics file over an object, a log over `names.log`, a
    shipped file in `objects/`), its directory exists, and nothing but a regular file or a
    symlink is at it (`directory`: a directory, or nothing yet; `parents`: the writer makes
    a missing directory). The one rule every user-named output goes through. Raises
    UsageError before any work is done."""
    given: object = path  # the API boundary: callers may pass anything
    if not isinstance(given, str | Path) or "\0" in str(given) or str(given) == "":
        raise UsageError(f"{what}: a path is a non-empty str or Path, not {given!r:.80}")
    path = Path(given)
    try:
        inside = registry_holding(path, registry=registry)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what} {path}: {exc}") from None
    if inside is not None:
        why = f"{what} {path}: inside the registry at {inside}; refused (it would overwrite it)"
        raise UsageError(why, hint=f"name a {what} path outside {inside}")
    if directory:  # a missing one is the transport's to report, destination by destination
        if os.path.lexists(path) and not path.is_dir():
            raise UsageError(f"{what} {path}: not a directory; refused")
        return path
    if not path.parent.is_dir() and not (parents and not os.path.lexists(path.parent)):
        raise UsageError(f"{what} {path}: the directory {path.parent} does not exist")
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise UsageError(f"{what} {path}: {kind}; refused (it would be replaced)")
    return path


def refuse_shared(st: os.stat_result, path: Path | str) -> None:
    """Refuse (UsageError) a file another local user could have written: owned by another
    user (root too refuses a file of another user's), or group- or world-writable."""
    me = os.geteuid()
    if st.st_uid != me:
        raise UsageError(f"{path}: owned by uid {st.st_uid}, not by this user (uid {me}); refused")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(st.st_mode)
        raise UsageError(f"{path}: group- or world-writable (mode {mode:o}; chmod go-w); refused")

"""The files a user names on the command line or to the API: prefix, tools, corpus, session
and pool files to read, metrics and HTML files to write. None of them is a registry path.

Invariants:
- A file a user names is read only if it is a regular file (checked before the open and again
  on the descriptor: a FIFO never blocks, a directory is refused), and only up to a size cap.
- One they name for output replaces only a regular file (or a symlink: the link, not its
  target); a directory, FIFO, device or socket there is refused before any work is done.
- A file whose lines are sent on with the user's key (a keeper's `--session`) is used only if
  no other local user could have written it (`refuse_shared`).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, UsageError
from prefixreg.registry.fsutil import read_fd

MAX_INPUT_BYTES: Final = 64 << 20  # a user's prefix, tools or corpus file: far above any context
_READ: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC  # a planted FIFO must not hang the open


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


def check_output_file(path: Path, what: str) -> Path:
    """`path` if a user's output file may be written there (`replace_atomic`): its directory
    exists and nothing but a regular file or a symlink is at it. Raises UsageError before any
    work is done: a missing directory, or a directory, FIFO, device or socket in its place."""
    if not path.parent.is_dir():
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

"""Filesystem primitives: durable atomic writes, no-follow reads, directory fsync.

Invariants:
- A published file is complete: data goes to a temp file in the target directory, is
  fsynced and chmodded, then renamed (or hard-linked, for no-overwrite publishes), then the
  directory is fsynced. A crash leaves at most a temp file named `.<name>.<random>.tmp`,
  which `verify` reports as a stray and `gc` removes.
- Reads never follow a symlink (`O_NOFOLLOW`): a symlink where a registry file should be
  is refused, never read through.
- Modes honour the umask: the requested mode is masked by it (objects end up 0444).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from prefixreg.errors import IntegrityError

__all__ = [
    "TMP_SUFFIX",
    "append_line",
    "fsync_dir",
    "is_temp_name",
    "publish_new",
    "read_nofollow",
    "replace_atomic",
    "umask_mode",
]

TMP_SUFFIX = ".tmp"


def _current_umask() -> int:
    # os.umask can only be read by setting it; set it straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_mode(mode: int) -> int:
    """`mode` with the process umask applied, as `open(..., mode)` would do."""
    return mode & ~_current_umask()


def is_temp_name(name: str) -> bool:
    """True for the temp files this module creates (`.<target>.<random>.tmp`)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or link in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(directory: Path, target_name: str, data: bytes, mode: int) -> Path:
    fd, tmp_name = tempfile.mkstemp(dir=directory, prefix=f".{target_name}.", suffix=TMP_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, umask_mode(mode))
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def replace_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` durably, replacing any previous file atomically."""
    tmp = _write_temp(path.parent, path.name, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def publish_new(path: Path, data: bytes, *, mode: int = 0o444) -> bool:
    """Publish `data` at `path` only if nothing is there yet; never overwrite.

    Returns True if this call created the file, False if a file already existed (the
    caller decides what an existing file means, e.g. re-verifies an object).
    """
    tmp = _write_temp(path.parent, path.name, data, mode)
    try:
        os.link(tmp, path)
        created = True
    except FileExistsError:
        created = False
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    if created:
        fsync_dir(path.parent)
    return created


def read_nofollow(path: Path | str) -> bytes:
    """Read a regular file without following a symlink.

    Raises:
        FileNotFoundError: nothing at `path`.
        IntegrityError: `path` is a symlink or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(f"{path}: is a symlink; refused", path=Path(path)) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{path}: not a regular file; refused", path=Path(path))
        # One read of the known size (+1 to see growth); loop only if the file grew.
        data = os.read(fd, st.st_size + 1)
        if len(data) <= st.st_size:
            return data
        chunks = [data]
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def append_line(path: Path, line: bytes, *, mode: int = 0o644) -> None:
    """Append one line to a journal with a single write, then fsync it.

    O_APPEND makes each write land whole at the end even with concurrent appenders; callers
    that need ordering hold a lock around the append.
    """
    if not line.endswith(b"\n"):
        line += b"\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)

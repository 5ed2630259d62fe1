"""Filesystem primitives: durable atomic writes, no-follow reads, directory fsync.

Invariants:
- A published file is complete: data goes to a temp file in the target directory, is
  fsynced and chmodded, then renamed (or hard-linked, for no-overwrite publishes), then the
  directory is fsynced. A crash leaves at most a temp file named `.<name>.<random>.tmp`,
  which `verify` reports as a stray and `gc` removes.
- Reads never follow a symlink (`O_NOFOLLOW`): a symlink where a registry file should be
  is refused, never read through. Given the registry root, every component below it is
  opened with `O_NOFOLLOW` relative to its parent's descriptor, so a symlinked directory
  (`objects/ab`, `names`) is refused too, without a check-then-open race. Writes check the
  directories they write into the same way (`check_no_symlinks`) before creating anything.
- Modes honour the umask: files are created with their final mode and the kernel masks it
  (objects end up 0444 & ~umask); nothing reads or sets the process umask.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from prefixreg.core.errors import IntegrityError
from prefixreg.registry.layout import TMP_SUFFIX, is_temp_name

__all__ = [
    "TMP_SUFFIX",
    "append_line",
    "check_no_symlinks",
    "copy_durable",
    "ensure_dir",
    "fsync_dir",
    "is_temp_name",
    "list_dir",
    "publish_new",
    "read_nofollow",
    "replace_atomic",
]


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or link in it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """Write every byte (os.write may write fewer), then fsync."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def _write_temp(directory: Path, target_name: str, data: bytes, mode: int) -> Path:
    # Created with its final mode: the kernel applies the umask, so there is no chmod to
    # journal and no umask to read; the creating descriptor can write a read-only file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = directory / f".{target_name}.{os.urandom(6).hex()}{TMP_SUFFIX}"
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temp file name in {directory}")
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
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


_REAL_ROOTS: dict[str, str] = {}


def _open_nofollow(path: Path | str, root: Path | str | None, flags: int) -> int:
    """Open `path` without following a symlink at it or (given `root`) at any directory
    between `root` and it. `root` itself may be a symlink: that is the user's choice.

    The last component is opened with `O_NOFOLLOW`; the directories above it are checked by
    asking the kernel where the descriptor really points (`/proc/self/fd`): one readlink
    instead of one open per component, on the hot path of every verified read. A path with
    `..` or a symlinked directory never matches the canonical answer and goes to the
    component-by-component walk, which refuses it by name. Without /proc, the walk is used.
    """
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(f"{path}: is a symlink; refused", path=Path(path)) from exc
        if exc.errno == errno.ENOTDIR and root is not None:
            return _open_walk(path, root, flags)  # names the offending component
        raise
    if root is None:
        return fd
    root_s, path_s = os.fspath(root), os.fspath(path)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")  # noqa: PTH115 -- a descriptor, not a path
    except OSError:
        real = None
    rel = path_s[len(root_s) :] if path_s.startswith(root_s) else ""
    if real is not None and rel.startswith("/"):
        for fresh in (False, True):  # the cached real root may be stale: look once more
            base = _REAL_ROOTS.get(root_s) if not fresh else None
            if base is None:
                base = _REAL_ROOTS[root_s] = os.path.realpath(root_s)
            if real == base + rel:
                return fd
    os.close(fd)
    return _open_walk(path, root, flags)  # raises, naming the symlinked directory


def _open_walk(path: Path | str, root: Path | str, flags: int) -> int:
    """Open `path` one component at a time below `root`, each relative to its parent's
    descriptor with `O_NOFOLLOW`: no check-then-open race, and the error names the
    symlinked component."""
    root_s, path_s = os.fspath(root).rstrip("/"), os.fspath(path)
    if not path_s.startswith(root_s + "/"):
        raise IntegrityError(f"{path}: not a path inside {root}", path=Path(path))
    parts = [p for p in path_s[len(root_s) + 1 :].split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise IntegrityError(f"{path}: not a path inside {root}", path=Path(path))
    dir_fd = -1  # the first component is opened by path: the root's own path is followed
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            want = flags if last else os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                if dir_fd < 0:
                    fd = os.open(f"{root_s}/{part}", want)
                else:
                    fd = os.open(part, want, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = Path(root, *parts[: i + 1])
                    try:
                        st = os.lstat(part, dir_fd=dir_fd) if dir_fd >= 0 else where.lstat()
                        is_link = stat.S_ISLNK(st.st_mode)
                    except OSError:
                        is_link = False
                    if is_link:
                        raise IntegrityError(f"{where}: is a symlink; refused", path=where) from exc
                    if exc.errno == errno.ENOTDIR:
                        raise IntegrityError(
                            f"{where}: not a directory; refused", path=where
                        ) from exc
                raise
            if dir_fd >= 0:
                os.close(dir_fd)
            dir_fd = fd
        fd, dir_fd = dir_fd, -1
        return fd
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)


def read_nofollow(path: Path | str, *, root: Path | str | None = None) -> bytes:
    """Read a regular file without following a symlink.

    Args:
        root: the registry root `path` lies under; when given, no directory between the
            two may be a symlink either.

    Raises:
        FileNotFoundError: nothing at `path`.
        IntegrityError: `path` (or a directory below `root`) is a symlink, or `path` is
            not a regular file.
    """
    # O_NONBLOCK: a FIFO planted at a record's path must not hang the read before the
    # regular-file check refuses it (it has no effect on regular files).
    fd = _open_nofollow(path, root, os.O_RDONLY | os.O_NONBLOCK)
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


def check_no_symlinks(root: Path, directory: Path) -> None:
    """Refuse to write into `directory` if it, or any directory between `root` and it, is a
    symlink (a write would land outside the registry). Missing directories are fine.

    Raises:
        IntegrityError: a symlink (or a non-directory) on the way.
    """
    current = root
    for part in directory.relative_to(root).parts:
        current = current / part
        try:
            st = current.lstat()
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise IntegrityError(f"{current}: is a symlink; refused", path=current)
        if not stat.S_ISDIR(st.st_mode):
            raise IntegrityError(f"{current}: not a directory; refused", path=current)


def copy_durable(src: Path, dst: Path, *, root: Path | None = None) -> bytes:
    """Copy a regular file to `dst` (which must not exist) durably, keeping mode and mtime.

    The bytes are read once without following symlinks (below `root`, if given), written to
    a temp file next to `dst`, fsynced, given the source's mode and mtime, then linked into
    place (no overwrite) and the directory fsynced. Returns the bytes copied so the caller
    can compare the target against exactly what was read.

    Raises:
        FileExistsError: `dst` exists. IntegrityError: `src` is a symlink or not a file.
    """
    fd = _open_nofollow(src, root, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{src}: not a regular file; refused", path=src)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    tmp = _write_temp(dst.parent, dst.name, data, 0o600)
    try:
        # The source's mode already had its creator's umask applied: keep it as it is.
        os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        os.link(tmp, dst)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    fsync_dir(dst.parent)
    return data


def append_line(path: Path, line: bytes, *, mode: int = 0o644, root: Path | None = None) -> None:
    """Append one line to a journal with a single write, then fsync it.

    O_APPEND makes each write land whole at the end even with concurrent appenders; callers
    that need ordering hold a lock around the append. Given `root`, no directory between it
    and the journal may be a symlink; the journal itself never is (`O_NOFOLLOW`).

    Raises:
        IntegrityError: the journal (or a directory below `root`) is a symlink.
        OSError: the journal cannot be written (the caller reports what was not done).
    """
    if not line.endswith(b"\n"):
        line += b"\n"
    if root is not None:
        check_no_symlinks(root, path.parent)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise IntegrityError(f"{path}: is a symlink; refused", path=path) from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IntegrityError(f"{path}: not a regular file; refused", path=path)
        _write_all(fd, line)
    finally:
        os.close(fd)


Kind = str  # "file", "dir", "link" or "other" (FIFO, socket, device)


def list_dir(path: Path | str, *, root: Path | str) -> list[tuple[str, Kind]]:
    """The entries of a registry directory as sorted (name, kind) pairs, never following a
    symlink: the directory is opened with `O_NOFOLLOW` below `root` and each entry's kind
    comes from `lstat` semantics. A missing directory lists as empty.

    Raises:
        IntegrityError: `path` (or a directory between `root` and it) is a symlink or not a
            directory.
    """
    try:
        if os.fspath(path).rstrip("/") == os.fspath(root).rstrip("/"):
            # The root itself may be a symlink (a user's choice): list what it names.
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            fd = _open_nofollow(path, root, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return []
    try:
        out: list[tuple[str, Kind]] = []
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_symlink():
                    kind = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kind = "dir"
                elif entry.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                out.append((entry.name, kind))
    finally:
        os.close(fd)
    out.sort()
    return out


def ensure_dir(root: Path, directory: Path, *, mode: int = 0o755) -> None:
    """Create `directory` (and any missing directory between `root` and it), refusing to
    pass through a symlink or a non-directory: nothing is ever created outside the root.

    Raises:
        IntegrityError: a symlink or a non-directory on the way.
    """
    current = root
    for part in directory.relative_to(root).parts:
        current = current / part
        for _ in range(2):
            try:
                st = current.lstat()
                break
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    current.mkdir(mode=mode)
        else:
            st = current.lstat()
        if stat.S_ISLNK(st.st_mode):
            raise IntegrityError(f"{current}: is a symlink; refused", path=current)
        if not stat.S_ISDIR(st.st_mode):
            raise IntegrityError(f"{current}: not a directory; refused", path=current)

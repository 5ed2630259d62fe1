"""Filesystem primitives: the one durable writer, untearable journal appends, no-follow reads
and streamed copies (the files a user names: `userfiles`).

Invariants:
- A published file is complete: a temp file in the target directory (created with its final
  mode, so the umask applies) is written and fsynced, then renamed (or hard-linked, never
  overwriting), then the directory is fsynced. A crash leaves at most a temp file
  `.<name>.<random>.tmp`, which `verify` reports and `gc` removes.
- A journal append lands whole or not at all: one write of the line at the end; a short or
  failed write (a full disk) truncates the file back. An append never glues its line onto a
  torn tail: that is refused until `verify --repair` heals it.
- Nothing below a registry root is reached through a symlink: each component is resolved with
  symlinks refused (`openat2` RESOLVE_NO_SYMLINKS, else one `O_NOFOLLOW` open per component),
  so a symlinked `names` or `objects/ab` is refused before anything is opened through it. The
  root itself may be a symlink (the user's choice). Writes check their directories first.
- A short read (Linux returns at most 0x7ffff000 bytes a call; FUSE and NFS fewer) is read
  on: a file ends at an empty read, or at a short one that reached the size fstat gave. A
  copy streams in `CHUNK`s (bounded memory at any size) and is refused, never published, if
  it ends short of its source's size when opened.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError
from prefixreg.registry.layout import TMP_SUFFIX

_DIR: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_READ: Final = os.O_RDONLY | os.O_NONBLOCK  # a planted FIFO must not hang the type check
CHUNK: Final = 1 << 20  # bytes per read when streaming: a copy's memory, whatever the file's size


def fsync_dir(path: Path | str) -> None:
    """fsync a directory so a rename or link in it survives a power loss."""
    fd = os.open(path, _DIR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_temp(directory: Path, target_name: str, chunks: Iterable[bytes], mode: int) -> Path:
    # 64 random bits: O_EXCL refuses a clash rather than clobber anything.
    tmp = directory / f".{target_name}.{os.urandom(8).hex()}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        for chunk in chunks:
            _write_all(fd, chunk)
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    finally:
        os.close(fd)
    return tmp


def _publish(path: Path, data: bytes, mode: int, *, replace: bool) -> bool:
    tmp = _write_temp(path.parent, path.name, (data,), mode)
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # no overwrite: the temp name goes below
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, FileExistsError) and not replace:
            return False
        raise
    if not replace:
        tmp.unlink()
    fsync_dir(path.parent)
    return True


def replace_atomic(path: Path, data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` durably, replacing any previous file atomically."""
    _publish(path, data, mode, replace=True)


def publish_new(path: Path, data: bytes, *, mode: int = 0o444) -> bool:
    """Publish `data` at `path` unless something is there (never overwritten); True if so."""
    return _publish(path, data, mode, replace=False)


# -- no-follow opens ----------------------------------------------------------------------------

_OPENAT2: dict[str, Callable[[int, str, int], int] | None] = {}  # probed once per process
_WALKS = [0]  # walks so far: a short-lived command never pays for importing ctypes


def _openat2() -> Callable[[int, str, int], int] | None:
    """`openat2` (RESOLVE_NO_SYMLINKS|BENEATH, Linux 5.6+) after 32 walks; else None."""
    if "fn" in _OPENAT2:
        return _OPENAT2["fn"]
    _WALKS[0] += 1
    if _WALKS[0] <= 32:
        return None
    _OPENAT2["fn"] = None
    if sys.platform.startswith("linux"):
        import ctypes
        import struct

        syscall = ctypes.CDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        hows: dict[int, ctypes.Array[ctypes.c_char]] = {}

        def call(dirfd: int, rel: str, flags: int) -> int:
            if flags not in hows:  # struct open_how {flags, mode, resolve}
                hows[flags] = ctypes.create_string_buffer(struct.pack("QQQ", flags, 0, 0x0C))
            fd = int(syscall(437, dirfd, rel.encode(), hows[flags], 24))  # SYS_openat2
            if fd < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code), rel)
            return fd

        with contextlib.suppress(OSError):
            os.close(call(-100, ".", _DIR))  # AT_FDCWD: is it there at all?
            _OPENAT2["fn"] = call
    return _OPENAT2["fn"]


def _refused(exc: OSError, where: Path | str, *, last: bool = True) -> Exception:
    """A symlink (ELOOP) or a file where a directory should be: `IntegrityError`; else OSError."""
    if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and not last):
        what = "is a symlink" if exc.errno == errno.ELOOP else "not a directory"
        return IntegrityError(f"{where}: {what}; refused", path=Path(where))
    return OSError(exc.errno, exc.strerror, str(where))


def open_below(root: str, rel: str, flags: int) -> int:
    """Open `root/rel`, following no symlink in `rel`. Raises: FileNotFoundError;
    IntegrityError (naming a symlink or non-directory on the way, or `rel` leaving `root`)."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    openat2 = _openat2() if "/" in rel else None  # an entry of the root: the walk is one open
    if openat2 is not None:
        base = os.open(root, _DIR)
        try:
            return openat2(base, rel, flags)
        except OSError as exc:  # a link or a non-directory on the way: the walk names it
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
                raise _refused(exc, f"{root}/{rel}") from None
        finally:
            os.close(base)
    parts = rel.split("/")
    if "" in parts or "." in parts or ".." in parts:
        raise IntegrityError(f"{root}/{rel}: not a path inside {root}", path=Path(root, rel))
    fd = os.open(root, _DIR)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                child = os.open(part, flags if last else _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                with contextlib.suppress(OSError):  # O_DIRECTORY answers ENOTDIR for a link
                    if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode):
                        exc.errno = errno.ELOOP
                raise _refused(exc, Path(root, *parts[: i + 1]), last=last) from None
            os.close(fd)
            fd = child
        fd, child = -1, fd
        return child
    finally:
        if fd >= 0:
            os.close(fd)


def read_fd(fd: int, where: Path | str, limit: int = 1 << 62) -> tuple[bytes, os.stat_result]:
    """A regular file's bytes from `fd` (closed here) to its end, at most `limit` + 1 of them."""
    try:
        st = os.fstat(fd)  # inline, not `_regular`: every verified get pays this path
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{where}: not a regular file; refused", path=Path(where))
        want = min(st.st_size, limit) + 1  # its size and a byte more (growth shows): one call
        data = os.read(fd, want)
        if st.st_size <= len(data) < want:
            return data, st  # short at the size fstat gave: its end (the common case)
        chunks, size, ask = [data], len(data), want - len(data)
        while data and size <= limit:
            want = min(max(ask, CHUNK), limit + 1 - size)  # a short read: the rest; growth: on
            if not (data := os.read(fd, want)):
                break
            chunks.append(data)
            size, ask = size + len(data), ask - len(data)
            if len(data) < want and size >= st.st_size:
                break  # short at the size fstat gave: its end
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _regular(fd: int, where: Path | str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise IntegrityError(f"{where}: not a regular file; refused", path=Path(where))
    return st


def _open_path(path: Path | str, root: Path | str | None, flags: int) -> int:
    path_s = os.fspath(path)
    if root is None:
        try:
            return os.open(path_s, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _refused(exc, path_s) from None
    root_s = os.fspath(root).rstrip("/")
    if not path_s.startswith(root_s + "/"):
        raise IntegrityError(f"{path}: not a path inside {root}", path=Path(path))
    return open_below(root_s, path_s[len(root_s) + 1 :], flags)


def read_nofollow(
    path: Path | str, *, root: Path | str | None = None, limit: int = 1 << 62
) -> bytes:
    """A regular file's bytes (at most `limit` + 1), no symlink followed at it (or below
    `root`, if given). Raises: FileNotFoundError; IntegrityError."""
    return read_fd(_open_path(path, root, _READ), path, limit)[0]


def read_chunks(path: Path) -> Iterator[bytes]:
    """A regular file's bytes in 1 MiB chunks, never through a symlink at `path`. Raises:
    FileNotFoundError; IntegrityError."""
    fd = open_regular(path, None)[0]
    try:
        while chunk := os.read(fd, CHUNK):
            yield chunk
    finally:
        os.close(fd)


def read_below(root: str, rel: str) -> bytes:
    """`read_nofollow` of `root/rel`: the hot path of every verified read."""
    return read_fd(open_below(root, rel, _READ), f"{root}/{rel}")[0]


def open_dir(root: str, rel: str) -> int:
    """A descriptor of the directory `root/rel` ("" the root), opened as `open_below` opens.
    Raises: FileNotFoundError; IntegrityError."""
    try:
        return os.open(root, _DIR) if not rel else open_below(root, rel, _DIR)
    except NotADirectoryError:
        raise IntegrityError(f"{root}/{rel}: not a directory; refused") from None


def kind_of(entry: os.DirEntry[str]) -> str:
    """`file`, `dir`, `link` or `other`, from the listing (nothing followed)."""
    if entry.is_file(follow_symlinks=False):  # the common case first: one call
        return "file"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    return "link" if entry.is_symlink() else "other"


def list_below(root: str, rel: str) -> list[tuple[str, str]]:
    """Sorted (name, kind) entries of `root/rel` ("" the root), kind `file`, `dir`, `link` or
    `other`, nothing followed; a missing directory is empty. Raises: IntegrityError."""
    try:
        fd = open_dir(root, rel)
    except FileNotFoundError:
        return []
    try:
        with os.scandir(fd) as entries:
            out = [(entry.name, kind_of(entry)) for entry in entries]
    finally:
        os.close(fd)
    return sorted(out)


def ensure_dir(root: Path, directory: Path, *, create: bool = True) -> None:
    """Check (with `create`, make) every directory from `root` down to `directory`; a missing
    one ends a check. Raises: IntegrityError (a symlink or non-directory on the way)."""
    current = os.fspath(root)
    for part in directory.relative_to(root).parts:
        current = f"{current}/{part}"  # strings: a check per lstat on every registry read
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return
            with contextlib.suppress(FileExistsError):
                Path(current).mkdir()
            st = os.lstat(current)
        if not stat.S_ISDIR(st.st_mode):
            what = "is a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise IntegrityError(f"{current}: {what}; refused", path=Path(current))


def open_regular(path: Path, root: Path | None) -> tuple[int, os.stat_result]:
    """A descriptor (the caller closes it) of a regular file, no-follow below `root`, and its
    stat. Raises: FileNotFoundError; IntegrityError (a symlink or not a regular file)."""
    fd = _open_path(path, root, _READ)
    try:
        return fd, _regular(fd, path)
    except BaseException:
        os.close(fd)
        raise


def copy_durable(src: Path, dst: Path, *, root: Path | None = None, replace: bool = False) -> str:
    """Copy a regular file (streamed, no-follow below `root`) durably to `dst` with its mode
    and mtime, never overwriting unless `replace`; the sha256 of the bytes copied, to compare
    the target with. Raises: FileExistsError (`dst` exists); IntegrityError (`src` is a
    symlink or not a file, or ended short of the size it had when opened)."""
    fd, st = open_regular(src, root)
    digest = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        copied = 0
        while chunk := os.read(fd, CHUNK):
            digest.update(chunk)
            copied += len(chunk)
            yield chunk
        if copied < st.st_size:  # cut under us: never publish a file with its tail missing
            why = f"{src}: read {copied:,} of its {st.st_size:,} bytes; refusing to copy it"
            raise IntegrityError(why, path=src)

    try:
        tmp = _write_temp(dst.parent, dst.name, chunks(), 0o600)
    finally:
        os.close(fd)
    try:
        os.chmod(tmp, stat.S_IMODE(st.st_mode))  # the source's mode, its umask applied
        os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
        (os.replace if replace else os.link)(tmp, dst)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    fsync_dir(dst.parent)
    return digest.hexdigest()


def _open_journal(path: Path, root: Path | None, flags: int) -> int:
    if root is not None:
        ensure_dir(root, path.parent, create=False)
    try:
        fd = os.open(path, flags | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise _refused(exc, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path}: not a regular file; refused", path=path)
    return fd


def append_line(path: Path, line: bytes, *, root: Path | None = None) -> int:
    """Append one line to a journal, whole or not at all; the offset it starts at (to take it
    back with `truncate` under the journal's lock). Raises: IntegrityError (a symlink or
    non-file on the way, or a torn last line); OSError (not written, nothing of it left)."""
    fd = _open_journal(path, root, os.O_APPEND | os.O_CREAT)
    try:
        start = os.fstat(fd).st_size
        if start and os.pread(fd, 1, start - 1) != b"\n":
            torn = IntegrityError(f"{path}: ends in a torn line; refusing to append", path=path)
            torn.hint = "run prefixreg verify --repair (it cuts off the interrupted write)"
            raise torn
        try:
            _write_all(fd, line if line.endswith(b"\n") else line + b"\n")
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
                os.fsync(fd)
            raise
        return start
    finally:
        os.close(fd)


def truncate(path: Path, size: int, *, root: Path | None = None) -> None:
    """Cut a journal back to `size` bytes, durably (a line taken back, a torn tail cut)."""
    fd = _open_journal(path, root, 0)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)

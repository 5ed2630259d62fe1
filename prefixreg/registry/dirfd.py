"""A directory's entries and files through one descriptor: the bulk reads of `verify` and
`ls`, which list and read every object and record.

Invariants (those of `fsutil.open_below`, kept per file): the directory is opened with no
symlink followed on the way, and each file in it by name with O_NOFOLLOW, so a symlink is
refused exactly as a walk per file would refuse it, at one open per file instead of one per
component; a listing's lstat is taken in that descriptor (`fstatat`, nothing followed).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Generator, Iterable

from prefixreg.core.errors import IntegrityError
from prefixreg.registry.fsutil import _READ, kind_of, open_dir, read_fd
from prefixreg.registry.fsutil import _refused as refused

Scanned = tuple[str, str, os.stat_result | None]  # (name, kind, lstat or None: not asked)


def scan_below(root: str, rel: str, skip: Callable[[str, str], bool]) -> list[Scanned]:
    """`list_below` with each entry's lstat, taken in the directory's descriptor (nothing
    followed), except for the entries `skip(name, kind)` is true of (their stat comes from
    the descriptor they are read through: one syscall fewer each). Raises: IntegrityError."""
    try:
        fd = open_dir(root, rel)
    except FileNotFoundError:
        return []
    out: list[Scanned] = []
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                kind = kind_of(entry)
                if skip(entry.name, kind):
                    out.append((entry.name, kind, None))
                    continue
                try:
                    out.append((entry.name, kind, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:  # removed since it was listed: not there
                    pass
    finally:
        os.close(fd)
    out.sort(key=operator.itemgetter(0))
    return out


ReadResult = tuple[bytes, os.stat_result] | Exception


def read_each(
    root: str, rel: str, names: Iterable[str]
) -> Generator[tuple[str, ReadResult], None, None]:
    """Each regular file `names` of the directory `root/rel` ("" the root): its bytes and
    fstat, or the error (`FileNotFoundError`, `IntegrityError` for a symlink or non-file, any
    OSError). The directory is opened once, no-follow as `open_below` does, and each file in
    it with O_NOFOLLOW: the same refusals as `read_below`, without a walk per file (verify
    and ls read every object and record). Raises: FileNotFoundError, IntegrityError (the
    directory itself)."""
    fd = open_dir(root, rel)
    base = f"{root}/{rel}" if rel else root
    try:
        for name in names:
            where = f"{base}/{name}"
            try:
                child = os.open(name, _READ | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                yield name, refused(exc, where)
                continue
            try:
                yield name, read_fd(child, where)
            except (OSError, IntegrityError) as exc:
                yield name, exc
    finally:
        os.close(fd)

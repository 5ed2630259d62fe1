"""Registry trees for `migrate`: list, bring across (copy, merge, catch up), verify, remove.

Invariants:
- Listing is no-follow: a symlink below the root, or an entry neither a file nor a directory,
  raises `IntegrityError`, so nothing outside a registry is read or copied.
- `sync` is the one way a file crosses: copied durably (`fsutil.copy_durable`, with the
  source's mode and mtime) when the target lacks it; replaced only for a known kind of write
  (a journal the target holds a prefix of, a meta record the target left alone); any other
  difference stops the move. Every file written is re-read and compared with the source's.
- Files are copied, hashed and compared streamed in `fsutil.CHUNK`s, every byte of both
  files read (a short read is read on), so memory stays bounded whatever a file's size; only
  a journal or meta record being replaced is held whole (for `Undo`).
- Nothing written to the source during a copy or merge is lost (`retire_source`): it is
  caught up until a round finds nothing new, renamed aside, caught up once more, and only
  then removed; a file changed at both ends, an object whose bytes changed, or a source that
  keeps changing stops the move with the source kept.
- `remove_tree` removes names first, then meta, then the rest, so an interrupted removal
  never leaves a name or meta record without its object.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry import fsutil, layout
from prefixreg.registry.disk import Disk
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry

# Files that belong to the target registry itself, never compared with the source's.
OWN: Final = frozenset({layout.MARKER, layout.README, layout.MIGRATIONS_LOG})
PROGRESS_EVERY: Final = 500  # files between two progress lines of `sync`
Stat = tuple[int, int, int]  # size, mtime_ns, inode: any write changes at least one
Relation = Literal["same", "prefix", "differs"]


def write_order(rel: str) -> tuple[int, str]:
    """Objects before what refers to them, names after records, journals last."""
    top = rel.split("/", 1)[0]
    rank = {layout.OBJECTS: 1, layout.META: 2, layout.FRAMES: 4, layout.NAMES: 5}
    if top in layout.JOURNALS:
        return 6, rel
    return rank.get(top, 3 if "/" in rel else 0), rel


def list_tree(root: Path) -> tuple[list[str], list[str]]:
    """(directories, files) below `root`, relative, files in write order, lock and temp
    files skipped. Raises: IntegrityError (a symlink or special file)."""
    dirs: list[str] = []
    files: list[str] = []
    for rel, kind in Disk(root, marked=False).walk():
        if kind in ("link", "other"):
            why = f"{root / rel}: {'symlink' if kind == 'link' else 'special file'} in the registry"
            raise IntegrityError(f"{why}; refusing to migrate it", path=root / rel)
        parts = rel.split("/")
        if (parts[0] == layout.LOCKS and len(parts) > 1) or any(map(layout.is_temp_name, parts)):
            continue
        (dirs if kind == "dir" else files).append(rel)
    dirs.sort()
    files.sort(key=write_order)
    return dirs, files


def stats(root: Path, files: Iterable[str]) -> dict[str, Stat]:
    out: dict[str, Stat] = {}
    for rel in files:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(root / rel)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def check_verifies(reg: Registry, what: str) -> list[str]:
    """Raise unless `reg` verifies; its insecure-mode findings, as warnings (modes travel with
    the registry and are the user's to fix)."""
    findings = verify_registry(reg).findings
    problems = [f for f in findings if f.severity == "problem" and f.kind != "insecure_mode"]
    if problems:
        first = problems[0]
        why = f"{len(problems)} problems; first: {first.kind} {first.path}: {first.message}"
        raise IntegrityError(f"{what} {reg.root} does not verify ({why})")
    return [f"{f.path}: {f.message}" for f in findings if f.kind == "insecure_mode"]


def read_upto(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`, fewer only at its end: a short read is read on. Raises: OSError."""
    data = os.read(fd, size)
    if not data or len(data) == size:
        return data  # the common case: one call
    chunks, got = [data], len(data)
    while got < size and (chunk := os.read(fd, size - got)):
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def sha256_file(path: Path, root: Path) -> str:
    """The sha256 of a regular file below `root` (no-follow), streamed to its end. Raises:
    FileNotFoundError; IntegrityError."""
    fd, _st = fsutil.open_regular(path, root)
    digest = hashlib.sha256()
    try:
        while chunk := os.read(fd, fsutil.CHUNK):
            digest.update(chunk)
    finally:
        os.close(fd)
    return digest.hexdigest()


def compare(ours: Path, theirs: Path, *, root: Path, their_root: Path) -> Relation:
    """How `theirs` stands to `ours`, both streamed (no-follow) to the end of either: the
    "same" bytes, a proper "prefix" of ours, or it "differs". Raises: FileNotFoundError;
    IntegrityError."""
    fd = fsutil.open_regular(ours, root)[0]
    try:
        other = fsutil.open_regular(theirs, their_root)[0]
        try:
            while True:
                # Whole chunks at both ends (short reads read on), so the offsets stay in step.
                a, b = read_upto(fd, fsutil.CHUNK), read_upto(other, fsutil.CHUNK)
                if a != b:
                    return "prefix" if len(b) < fsutil.CHUNK and a.startswith(b) else "differs"
                if len(a) < fsutil.CHUNK:
                    return "same"
        finally:
            os.close(other)
    finally:
        os.close(fd)


def check_copies(dest: Path, digests: dict[str, str]) -> None:
    """Re-read every file written at the target (all of it) and compare with the source's."""
    for rel, expected in digests.items():
        actual = sha256_file(dest / rel, dest)
        if actual != expected:
            why = f"{dest / rel}: copy hashes to {actual}, the source to {expected}"
            raise IntegrityError(why, path=dest / rel, expected=expected, actual=actual)


def replace_keeping(path: Path, data: bytes, st: os.stat_result) -> None:
    """Atomically replace `path` with `data`, giving it the mode and mtime of `st`."""
    fsutil.replace_atomic(path, data, mode=stat.S_IMODE(st.st_mode))
    os.chmod(path, stat.S_IMODE(st.st_mode))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


@dataclass(slots=True)
class Undo:
    """What a merge added or replaced at the target, to take back if it fails."""

    added: list[Path] = field(default_factory=list)
    replaced: list[tuple[Path, bytes, os.stat_result]] = field(default_factory=list)

    def rollback(self) -> None:
        for path in reversed(self.added):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()
        for path, data, st in self.replaced:
            with contextlib.suppress(OSError):
                replace_keeping(path, data, st)


def sync(
    source: Path,
    target: Path,
    files: Sequence[str],
    *,
    dirs: Sequence[str] = (),
    untouched: dict[str, Stat] | None = None,
    undo: Undo | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Bring `files` (in write order) from `source` to `target`; {rel: sha256 written}.
    Missing: copied, directories made (the source's modes set last). Identical: left alone
    (a newer source mtime carried over). Different: replaced if a journal the target holds a
    prefix of, or a meta record whose target copy is as in `untouched`; else an object is an
    `IntegrityError`, anything else a conflict (`PrefixregError`). `undo` records writes;
    `progress` hears the file it is at every `PROGRESS_EVERY` files, and the last."""
    undo = undo if undo is not None else Undo()
    made = [rel for rel in dirs if not (target / rel).exists()]
    for rel in made:
        (target / rel).mkdir()
        undo.added.append(target / rel)
    digests: dict[str, str] = {}
    for done, rel in enumerate(files, 1):
        if progress is not None and (done % PROGRESS_EVERY == 0 or done == len(files)):
            progress(f"file {done:,} of {len(files):,}")
        src, dst = source / rel, target / rel
        if not dst.exists():
            digests[rel] = fsutil.copy_durable(src, dst, root=source)
            undo.added.append(dst)
            continue
        relation, src_st = compare(src, dst, root=source, their_root=target), src.lstat()
        if relation == "same":
            if src_st.st_mtime_ns > dst.lstat().st_mtime_ns:
                os.utime(dst, ns=(src_st.st_atime_ns, src_st.st_mtime_ns), follow_symlinks=False)
        elif layout.object_sha(rel) is not None:
            why = f"{src}: an object's bytes changed during the move; kept {source}"
            raise IntegrityError(why, path=src)
        elif (rel in layout.JOURNALS and relation == "prefix") or (
            untouched is not None
            and layout.meta_sha(rel) is not None
            and untouched.get(rel) == stats(target, [rel]).get(rel)
        ):
            theirs = fsutil.read_nofollow(dst, root=target)
            undo.replaced.append((dst, theirs, dst.lstat()))
            digests[rel] = fsutil.copy_durable(src, dst, root=source, replace=True)
        else:
            why = f"{rel} changed both at {source} and at {target} during the move; kept {source}"
            raise PrefixregError(why, hint="compare the two, then run migrate again")
    # Last, deepest first: a read-only source directory must not stop the copy into it.
    for rel in sorted(made, key=lambda d: d.count("/"), reverse=True):
        os.chmod(target / rel, stat.S_IMODE(os.lstat(source / rel).st_mode))
    return digests


def catch_up(
    source: Path, target: Path, before: dict[str, Stat], target_state: dict[str, Stat]
) -> list[str]:
    """One round: bring what changed at `source` since `before` to `target` (`sync`),
    verified; the paths written, in write order. `before` and `target_state` move on."""
    dirs, files = list_tree(source)
    now = stats(source, files)
    changed = [rel for rel in files if rel not in OWN and now.get(rel) != before.get(rel)]
    digests = sync(source, target, changed, dirs=dirs, untouched=target_state)
    if digests:
        check_copies(target, digests)
        check_verifies(Registry(target), "the migrated registry (after late writes)")
    before.update(now)
    target_state.update(stats(target, changed))
    return sorted(digests, key=write_order)


def retire_source(source: Path, target: Path, before: dict[str, Stat]) -> tuple[list[str], Path]:
    """Catch the target up with late writes, rename the source aside (a writer still using
    it fails from then on), catch up once more; (paths copied, where the source now is)."""
    target_state = stats(target, list_tree(target)[1])
    late: list[str] = []
    for _ in range(10):  # catch-up rounds before the source counts as never quiet
        copied = catch_up(source, target, before, target_state)
        late += copied
        if not copied:
            break
    else:
        kept = f"kept it (the copy at {target} is complete up to now)"
        hint = "stop whatever writes to it, then run migrate again (it finishes the move)"
        raise PrefixregError(f"{source} kept changing during the move; {kept}", hint=hint)
    retired = source.with_name(f".{source.name}.migrated-{secrets.token_hex(4)}")
    try:
        source.rename(retired)
    except OSError:
        return late, source  # a mount point (EBUSY, EXDEV): the last round found nothing
    fsutil.fsync_dir(source.parent)
    try:
        late += catch_up(retired, target, before, target_state)
    except BaseException:
        retired.rename(source)  # put it back: nothing is deleted
        fsutil.fsync_dir(source.parent)
        raise
    return late, retired


def remove_tree(root: Path, *, ordered: bool = True) -> None:
    """Remove a registry tree: names first, then meta, then everything else (`ordered`)."""

    def writable_and_retry(func: Callable[..., object], path: str, _exc: object) -> None:
        # A read-only directory (copied modes) cannot lose entries until it is writable.
        parent = Path(path).parent
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IMODE(parent.lstat().st_mode) | stat.S_IWUSR | stat.S_IXUSR)
        func(path)

    for sub in (layout.NAMES, layout.META) if ordered else ():
        path = root / sub
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, onerror=writable_and_retry)
    try:
        shutil.rmtree(root, onerror=writable_and_retry)
    except OSError as exc:
        why = f"could not remove {root} completely ({exc}); the migrated registry is complete"
        raise PrefixregError(why, hint=f"remove {root} by hand") from None

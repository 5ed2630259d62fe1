"""Writes that land on the source while `migrate` copies it: catch up, then retire.

Invariants:
- Nothing written to the source during a copy or merge is lost: the source is listed
  again (under its lock, no-follow) against a stat snapshot taken before the copy and
  whatever appeared or changed is copied across in write order and verified, until a
  listing finds nothing new. Only then is the source renamed aside.
- A file changed at both ends, an object whose bytes changed, or a source that keeps
  changing stops the move with the source kept where it was and nothing deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry import fsutil, layout
from prefixreg.registry.store import Registry
from prefixreg.registry.treecopy import (
    JOURNALS,
    OWN,
    check_copies,
    check_verifies,
    list_tree,
    read_in,
    replace_keeping,
    write_order,
)

__all__ = ["Stat", "retire_source", "stats"]

Stat = tuple[int, int, int]  # size, mtime_ns, inode: any write changes at least one
CATCH_UP_ROUNDS: Final = 10


def stats(root: Path, files: Iterable[str]) -> dict[str, Stat]:
    out: dict[str, Stat] = {}
    for rel in files:
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(root / rel)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def retire_source(source: Path, target: Path, before: dict[str, Stat]) -> tuple[list[str], Path]:
    """Copy what was written to the source during the move, then rename the source aside.

    Runs under the source's lock, after the target verified. Each round lists the source
    again and copies what appeared or changed since `before` (a stat snapshot taken before
    the copy); rounds repeat until one finds nothing. The source is then renamed to a
    hidden sibling (atomic; a writer that still uses the old path fails from then on
    instead of writing into a tree about to go) and caught up a last time from there. A
    source that cannot be renamed (a mount point) is removed in place after the quiet round.

    Returns:
        The relative paths copied across, and where the source now is (to be removed).

    Raises:
        PrefixregError / IntegrityError: a file changed at both ends, or the source kept
            changing; the source is kept where it was and nothing is deleted.
    """
    target_state = stats(target, list_tree(target)[1])
    late: list[str] = []
    for _ in range(CATCH_UP_ROUNDS):
        copied = catch_up(source, target, before, target_state)
        late += copied
        if not copied:
            break
    else:
        raise PrefixregError(
            f"{source} kept changing during the move; kept it (the copy at {target} is "
            "complete up to now)",
            hint="stop whatever writes to it, then run migrate again (it finishes the move)",
        )
    retired = source.with_name(f".{source.name}.migrated-{secrets.token_hex(4)}")
    try:
        source.rename(retired)
    except OSError:
        # A mount point cannot be renamed (EBUSY, EXDEV): remove it in place; the last
        # round found nothing new, under the lock.
        return late, source
    fsutil.fsync_dir(source.parent)
    try:
        late += catch_up(retired, target, before, target_state)
    except BaseException:
        retired.rename(source)  # put it back: nothing is deleted
        fsutil.fsync_dir(source.parent)
        raise
    return late, retired


def catch_up(
    source: Path, target: Path, before: dict[str, Stat], target_state: dict[str, Stat]
) -> list[str]:
    """One round: copy files new or changed at `source` since `before` to `target`.

    `before` and `target_state` are updated, so the next round sees only newer writes.
    Files new at the source are copied (no overwrite); changed ones replace the target's
    copy only where that is a known kind of write: a journal the target holds a prefix of
    (append-only), a meta record the target left alone since the move (a new note).
    Anything else that differs is a conflict. Objects are immutable: a changed object
    stat with the same bytes is a re-add (its mtime is carried over); different bytes are
    an integrity failure.
    """
    dirs, files = list_tree(source)
    now = stats(source, files)
    changed = [rel for rel in files if rel not in OWN and now.get(rel) != before.get(rel)]
    for rel in dirs:
        if not (target / rel).exists():
            (target / rel).mkdir()
            os.chmod(target / rel, stat.S_IMODE(os.lstat(source / rel).st_mode))
    digests: dict[str, str] = {}
    for rel in changed:
        dst = target / rel
        if not dst.exists():
            data = fsutil.copy_durable(source / rel, dst, root=source)
            digests[rel] = hashlib.sha256(data).hexdigest()
            continue
        ours, theirs = read_in(source / rel, source), read_in(dst, target)
        src_st = (source / rel).lstat()
        if ours == theirs:
            if src_st.st_mtime_ns > dst.lstat().st_mtime_ns:
                os.utime(dst, ns=(src_st.st_atime_ns, src_st.st_mtime_ns), follow_symlinks=False)
        elif layout.object_sha(rel) is not None:
            raise IntegrityError(
                f"{source / rel}: an object's bytes changed during the move; kept {source}",
                path=source / rel,
            )
        elif (rel in JOURNALS and ours.startswith(theirs)) or (
            layout.meta_sha(rel) is not None
            and target_state.get(rel) == stats(target, [rel]).get(rel)
        ):
            # A journal the source appended to, or a meta record whose note changed
            # (replaced at the source, untouched at the target since the move).
            replace_keeping(dst, ours, src_st)
            digests[rel] = hashlib.sha256(ours).hexdigest()
        else:
            raise PrefixregError(
                f"{rel} changed both at {source} and at {target} during the move; kept {source}",
                hint="compare the two, then run migrate again",
            )
    if digests:
        check_copies(target, digests)
        check_verifies(Registry(target), "the migrated registry (after late writes)")
    before.update(now)
    target_state.update(stats(target, changed))
    return sorted(digests, key=write_order)

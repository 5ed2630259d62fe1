"""Hashes on both ends of a mirror: source objects before they travel, and what arrived.

Role: `SourceVerifier` re-hashes source objects through the store (`Registry.read_verified`,
no-follow, regular files only) before any rsync sends them; `check_read_back` judges the
copies of just-sent objects that were fetched back from a destination into a local temp
directory. Path rules come from `registry.layout`.

Invariants:
- An object path is sent only after `SourceVerifier` returned it: a path that is not an
  object file, or bytes that do not hash to their name, raise `IntegrityError`.
- Objects are immutable and content-addressed, so a path verified once in a run is not
  hashed again; one verifier is shared by every destination of the run (thread-safe).
- `check_read_back` only reads the temp directory it is given (never a registry root) and
  never follows a symlink there.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

from prefixreg.core.errors import IntegrityError, RefNotFoundError
from prefixreg.registry.layout import object_sha
from prefixreg.registry.store import Registry

__all__ = ["SourceVerifier", "check_read_back"]


class SourceVerifier:
    """Re-hashes source objects before they travel; shared by all destinations of a run.

    An object removed at the source since the plan (a concurrent gc) is skipped: it is not
    returned, so it is not sent (the confirm pass sees the rest).
    """

    def __init__(self, reg: Registry) -> None:
        self.reg = reg
        self.count = 0
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, paths: Iterable[str]) -> list[str]:
        """The paths in `paths` that verified (vanished ones left out).

        Raises:
            IntegrityError: a path in objects/ that is not an object file (a symlink, a
                directory, a FIFO, a stray name), or an object whose bytes do not hash to
                its name.
        """
        ok = []
        for rel in paths:
            with self._lock:
                if rel in self._done:
                    ok.append(rel)
                    continue
            sha = object_sha(rel)
            if sha is None:
                raise IntegrityError(
                    f"{self.reg.root / rel}: not an object file; refusing to mirror it",
                    path=self.reg.root / rel,
                )
            try:
                self.reg.read_verified(sha)
            except RefNotFoundError:
                continue  # removed at the source since the plan: it will not be sent
            with self._lock:
                if rel not in self._done:
                    self._done.add(rel)
                    self.count += 1
            ok.append(rel)
        return ok


def check_read_back(local: Path, paths: Iterable[str]) -> list[str]:
    """What is wrong with the read-back copies of object `paths` under `local` (empty: none).

    A path missing under `local` did not arrive as a regular file (the read-back copies
    regular files only: a symlink, FIFO or device is skipped, a directory arrives empty).
    """
    problems = []
    for rel in paths:
        sha = object_sha(rel)
        path = local / rel
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            problems.append(f"{rel} is not a regular file")
            continue
        except OSError as exc:
            problems.append(f"{rel} cannot be read back ({exc.strerror})")
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                problems.append(f"{rel} is not a regular file")
                continue
            digest = hashlib.sha256()
            while chunk := os.read(fd, 1 << 20):
                digest.update(chunk)
        finally:
            os.close(fd)
        if digest.hexdigest() != sha:
            problems.append(f"{rel} hashes to {digest.hexdigest()}")
    return problems

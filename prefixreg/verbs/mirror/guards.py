"""The mirror's guards on its source and destinations, checked before anything is touched.

Role: refuse, with a `MirrorError` (exit 6), a run whose `--delete` could hit the wrong
directory. Invariants: the source is an origin registry holding objects; no local
destination is, holds or lies inside the source (`/` included); destinations are
de-duplicated and never nested. Only the source's marker and object list are read, through
the store; destinations are not touched here (`session` inspects them through rsync).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from prefixreg.core.errors import IntegrityError, MirrorError, RegistryLocationError
from prefixreg.registry.layout import MARKER
from prefixreg.registry.store import Registry
from prefixreg.verbs.mirror.rsync import Destination

__all__ = ["check_overlap", "check_source", "dedupe"]


def check_source(reg: Registry) -> None:
    """Refuse a source that is not an origin registry holding objects (`MirrorError`)."""
    try:
        role = reg.role
    except (RegistryLocationError, IntegrityError) as exc:
        raise MirrorError(f"source {reg.root} is not a usable registry: {exc}") from None
    if role is None:
        raise MirrorError(f"source {reg.root} is not a registry (no {MARKER}); refusing")
    if role != "origin":
        raise MirrorError(
            f"source {reg.root} is a {role}, not an origin registry; mirrors only flow "
            "from the coordinator's origin",
            hint="run the mirror on the coordinator, with --registry pointing at the origin",
        )
    if next(reg.iter_shas(), None) is None:
        raise MirrorError(f"source {reg.root} holds no objects; refusing to mirror (--delete)")


def check_overlap(source: Path, dest: Destination) -> None:
    """Refuse a local destination that is, contains, or lies inside the source (`/` too)."""
    if dest.is_remote:
        return
    src, dst = source.resolve(), Path(dest.path).resolve()
    if src.is_relative_to(dst) or dst.is_relative_to(src):
        raise MirrorError(f"destination {dest.raw} overlaps the source {source}; refusing")


def dedupe(parsed: Sequence[Destination]) -> list[Destination]:
    """Drop repeated destinations (by host and normalised path); refuse nested ones.

    Two spellings of one directory would run two rsyncs into it at once; a destination
    inside another would be deleted by the outer one's `--delete` and recreated by its own.
    Local paths are already resolved; remote ones are compared as written, normalised.
    """
    out: list[Destination] = []
    keys: list[tuple[str | None, PurePosixPath]] = []
    for dest in parsed:
        path = PurePosixPath(posixpath.normpath(dest.path))
        key = (dest.host, path)
        if key in keys:
            continue
        for (host, other), seen in zip(keys, out, strict=True):
            if host == dest.host and (path.is_relative_to(other) or other.is_relative_to(path)):
                raise MirrorError(
                    f"mirror destinations {seen.raw} and {dest.raw} are nested; refusing",
                    hint="give each worker its own directory",
                )
        keys.append(key)
        out.append(dest)
    return out

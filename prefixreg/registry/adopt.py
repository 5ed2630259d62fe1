"""`prefixreg migrate OLD --repoint`: adopt a hand-built registry (the seed's layout without
`REGISTRY.json`, its records in their own shapes) at a new path, and repoint the registry's
own README and `bin/` to it.

Invariants:
- Every object is hashed before anything is written; any bad one refuses the adoption, each
  named. Symlinks and special files are refused (`treecopy.list_tree`).
- History stays byte-identical: a meta or measurement record that does not parse as this
  format is listed with the sha256 of its bytes in `legacy.json` (read as legacy, verify warns
  once); `mirror.log` travels as it is. Root entries outside the format (`bin/`) are listed
  there as the user's and kept.
- The new registry is built in a hidden staging directory next to the target (copied and
  compared, objects made read-only, marker and manifest written, README and `bin/`
  repointed, verified) and renamed into place; the source goes last, after late writes are
  caught up, as in any move. On failure the source is untouched and the staging removed.
- Repointing is `refs.repoint`'s: never a worker path, never a history record.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from prefixreg.core.errors import CorruptRecordError, IntegrityError, RegistryLocationError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.refs import Repointed, repoint
from prefixreg.registry.store import Registry
from prefixreg.registry.treecopy import check_copies, check_verifies, list_tree, remove_tree, sync

Progress = Callable[[str], None]


def _current_shape(rel: str, raw: bytes) -> bool:
    """Does the meta or measurement record `rel` parse as this format and name its sha?"""
    from prefixreg.core.records import Measurement, Meta

    try:
        data = loads_object(raw)
        if (sha := layout.meta_sha(rel)) is not None:
            return Meta.from_dict(data).sha256 == sha
        name = rel.partition("/")[2]
        return Measurement.from_dict(data).sha256 == layout.measurement_sha(name)
    except CorruptRecordError:
        return False


Survey = tuple[list[str], list[str], dict[str, str], list[str]]


def survey(source: Path, *, progress: Progress | None = None) -> Survey:
    """(directories, files, legacy records {path: sha256}, kept root entries) of a hand-built
    registry, every object hashed (`progress` is told each file). Raises:
    RegistryLocationError (no `objects/`); IntegrityError (objects that do not verify, each
    named; a symlink or special file)."""
    if not (source / layout.OBJECTS).is_dir() or (source / layout.OBJECTS).is_symlink():
        raise RegistryLocationError(
            f"no registry at {source} (no {layout.MARKER}, no {layout.OBJECTS}/ directory)",
            hint=f"see {layout.FORMAT_DOC}",
        )
    dirs, files = list_tree(source)
    bad, legacy = [], {}
    for rel in files:
        if progress is not None:
            progress(rel)
        top = rel.partition("/")[0]
        if top == layout.OBJECTS:
            sha = layout.object_sha(rel)
            raw = fsutil.read_nofollow(source / rel, root=source)
            if sha is None or hashlib.sha256(raw).hexdigest() != sha:
                bad.append(f"{rel} ({'not an object file' if sha is None else 'hashes wrong'})")
        elif top in (layout.META, layout.MEASUREMENTS) and rel.endswith(".json"):
            raw = fsutil.read_nofollow(source / rel, root=source)
            if not _current_shape(rel, raw):
                legacy[rel] = hashlib.sha256(raw).hexdigest()
    if bad:
        raise IntegrityError(
            f"{source}: {len(bad)} objects do not verify, nothing adopted (an object is the "
            f"exact bytes its name hashes: {layout.FORMAT_DOC}): " + "; ".join(bad),
            path=source,
        )
    expected = {*layout.EXPECTED_DIRS, *layout.ROOT_FILES}
    kept = sorted({rel.partition("/")[0] for rel in [*dirs, *files]} - expected)
    return dirs, files, legacy, kept


def adopt(
    source: Path, given: Path, target: Path, surveyed: Survey
) -> tuple[list[str], list[Repointed]]:
    """Build the registry at `target` from the hand-built one at `source` (`given`: the
    path its files name; `surveyed`: its `survey`); (the verifier's warnings, the files
    repointed). The caller removes the source."""
    dirs, files, legacy, kept = surveyed
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.adopting-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        check_copies(staging, sync(source, staging, files, dirs=dirs))
        staging.chmod(stat.S_IMODE(source.stat().st_mode))
        for rel in files:
            if layout.object_sha(rel) is not None:
                os.chmod(staging / rel, stat.S_IMODE((staging / rel).lstat().st_mode) & ~0o222)
        now = layout.iso_utc(layout.utc_now())
        manifest = {"format": f"{layout.FORMAT}-legacy", "version": 1, "adopted": now}
        manifest |= {"from": str(source), "records": legacy, "kept": kept}
        fsutil.publish_new(staging / layout.LEGACY, dumps_canonical(manifest) + b"\n")
        fsutil.publish_new(staging / layout.MARKER, layout.encode_marker("origin", now), mode=0o644)
        repointed = repoint(staging, given, target, write=True)
        warnings = check_verifies(Registry(staging), "the adopted registry")
        staging.rename(target)  # replaces an empty target; one that gained files fails
    except BaseException:
        remove_tree(staging, ordered=False)
        raise
    fsutil.fsync_dir(target.parent)
    return warnings, repointed

"""Repointing a moved registry (`migrate`'s path work): `scan_references` lists the lines of
the user's files that still name a registry's old path (`migrate --scan`); `repoint` rewrites
the registry's own README and `bin/` to the new one; `survey` and `adopt` adopt a hand-built
registry (the seed's layout without `REGISTRY.json`, its records in their own shapes) at a
new path (`migrate --repoint`).

Invariants:
- One set of spellings of a path (`path_forms`: absolute, resolved, `~/`, `$HOME/`,
  `${HOME}/`, systemd's `%h/`), never matched inside a longer path name.
- The scan reads only the user's files, iteratively, never into a symlinked directory,
  skipping binary files (a NUL in the first 8 KiB), files over 8 MiB, VCS directories and
  the registries themselves.
- Repointing rewrites only those spellings, each to the same spelling of the new path, and
  never a worker path: a line assigning a variable whose name holds REMOTE (and the lines
  that assignment continues), or a `host:path` (the host a name or a shell variable), nor a
  history record. Each file is replaced atomically, its mode kept.
- Adopting hashes every object before anything is written; any bad one refuses the
  adoption, each named. Symlinks and special files are refused (`treecopy.list_tree`).
- Adopted history stays byte-identical: a meta or measurement record that does not parse as
  this format is listed with the sha256 of its bytes in `legacy.json` (read as legacy, verify
  warns once); `mirror.log` travels as it is. Root entries outside the format (`bin/`) are
  listed there as the user's and kept.
- What verify would call a problem in a hand-built tree is fixed in the copy and said:
  `names/` with no `names.log` gains a journal (a line per name, from none to its sha); an
  entry others can write (a 0777 `bin/` script) loses those bits (`modes.unsafe_write_bits`).
- The adopted registry is built in a hidden staging directory next to the target (copied and
  compared, objects made read-only, marker and manifest written, README and `bin/`
  repointed, verified) and renamed into place; the source goes last, after late writes are
  caught up, as in any move. On failure the source is untouched and the staging removed.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from prefixreg.core.errors import CorruptRecordError, IntegrityError, RegistryLocationError
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.modes import unsafe_write_bits
from prefixreg.registry.store import Registry
from prefixreg.registry.treecopy import (
    check_copies,
    check_verifies,
    list_tree,
    remove_tree,
    sha256_file,
    sync,
)

_SKIP_DIRS: Final = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__"})
# A worker path: a line assigning a variable whose name holds REMOTE (shell, Python with an
# annotation or `:=`), and the lines it continues (open brackets, a trailing backslash) ...
_REMOTE_ASSIGN: Final = re.compile(
    r"^\s*(?:export\s+|readonly\s+|local\s+)?\w*remote\w*\s*(?::[^=\n]*)?=", re.I
)
# ... or a path after `host:` (`w1:`, `user@w1:`, `$h:`, `${WORKER}:`, `w1:"...`).
_HOST_BEFORE: Final = re.compile(
    r"(?:^|[\s\"'=(,\[])(?:[\w.-]+@)?(?:\$\{?\w+\}?|[\w.-]+)(?:@[\w.-]+)?:[\"']?$"
)


@dataclass(frozen=True, slots=True)
class Repointed:
    """One file of the registry's own whose lines named the old path: `diff` is unified."""

    path: str
    lines: int
    diff: str


def path_forms(old: Path, new: Path | None = None) -> dict[str, str]:
    """Each spelling of `old` (module invariants) mapped to the same spelling of `new`
    (absolute when `new` is outside the home directory)."""
    forms = {str(old): str(new)}
    with contextlib.suppress(OSError):
        forms.setdefault(str(old.resolve()), str(new))
    for base in {Path.home(), Path.home().resolve()}:
        with contextlib.suppress(ValueError):
            rel = old.relative_to(base)
            try:
                new_rel: Path | None = (new or base).relative_to(base)
            except ValueError:
                new_rel = None
            for prefix in ("~", "$HOME", "${HOME}", "%h"):
                forms[f"{prefix}/{rel}"] = f"{prefix}/{new_rel}" if new_rel else str(new)
    return forms


def path_pattern(forms: Iterable[str]) -> re.Pattern[str]:
    """Any of `forms`, not followed by another path-name character (`~/prefix-registry-old`
    is another path)."""
    spelt = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return re.compile(f"(?:{spelt})" + r"(?![\w-]|\.\w)")


def repoint(root: Path, old: Path, new: Path, *, write: bool) -> list[Repointed]:
    """Repoint `README.md` and every text file under `bin/` of the tree at `root` from `old`
    to `new` (`write`: replace each atomically, mode kept); what changed, as diffs."""
    forms = path_forms(old, new)
    pattern = path_pattern(forms)

    def swap(line: str) -> str:  # never after a `host:`
        return pattern.sub(
            lambda m: m[0] if _HOST_BEFORE.search(line[: m.start()]) else forms[m[0]], line
        )

    def swap_all(text: str) -> str:  # never on a REMOTE assignment's lines
        out, held, continued = [], 0, False
        for line in text.splitlines(keepends=True):
            if held or continued or _REMOTE_ASSIGN.match(line):
                opened = sum(map(line.count, "([{")) - sum(map(line.count, ")]}"))
                held, continued = max(held + opened, 0), line.rstrip("\r\n").endswith("\\")
                out.append(line)
            else:
                out.append(swap(line))
        return "".join(out)

    files = [layout.README] + [rel for rel in list_tree(root)[1] if rel.startswith("bin/")]
    out = []
    for rel in files:
        path = root / rel
        try:
            data = fsutil.read_nofollow(path, root=root, limit=8 << 20)
        except FileNotFoundError:
            continue
        if b"\0" in data[:8192] or len(data) > 8 << 20:
            continue  # binary or huge: not a script or a README
        text = data.decode("utf-8", errors="surrogateescape")
        new_text = swap_all(text)
        if new_text == text:
            continue
        before, after = text.splitlines(keepends=True), new_text.splitlines(keepends=True)
        diff = "".join(difflib.unified_diff(before, after, f"{old}/{rel}", f"{new}/{rel}"))
        changed = sum(a != b for a, b in zip(before, after, strict=True))
        out.append(Repointed(str(new / rel), changed, diff))
        if write:
            mode = stat.S_IMODE(path.lstat().st_mode)
            data = new_text.encode("utf-8", errors="surrogateescape")
            fsutil.replace_atomic(path, data, mode=mode)
            os.chmod(path, mode)
    return out


@dataclass(frozen=True, slots=True)
class StaleReference:
    """One line of a file that still names the old registry path."""

    path: str
    line: int
    text: str


def scan_references(
    old: Path | str, dirs: Sequence[Path | str], *, skip: Sequence[Path | str] = ()
) -> list[StaleReference]:
    """Every file:line under `dirs` (directories or files) that still names `old`."""
    if not dirs:
        return []
    old = Path(old).expanduser().absolute()
    pattern = path_pattern(path_forms(old))
    skipped = {Path(p).expanduser().resolve() for p in skip} | {old.resolve()}
    found: list[StaleReference] = []
    for start in (Path(d).expanduser() for d in dirs):
        for path in [start] if start.is_file() else _files(start, skipped):
            found.extend(_scan_file(path, pattern))
    return found


def _files(start: Path, skip: set[Path]) -> Iterator[Path]:
    """Every file below `start`, sorted per directory, without recursion or following links."""
    pending = [start]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue  # unreadable: not ours to judge
        subdirs = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                path = Path(entry.path)
                if entry.name not in _SKIP_DIRS and path.resolve() not in skip:
                    subdirs.append(path)
            elif not entry.is_dir():
                yield Path(entry.path)
        pending.extend(reversed(subdirs))


def _scan_file(path: Path, pattern: re.Pattern[str]) -> list[StaleReference]:
    try:
        if not path.is_file() or path.stat().st_size > 8 << 20:
            return []
        data = path.read_bytes()
    except OSError:
        return []  # unreadable: not ours to judge
    if b"\0" in data[:8192]:
        return []
    text = data.decode("utf-8", errors="replace")
    return [
        StaleReference(str(path), lineno, line.strip()[:300])
        for lineno, line in enumerate(text.splitlines(), 1)
        if pattern.search(line)
    ]


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
    registry, every object hashed. Raises: RegistryLocationError (no `objects/`);
    IntegrityError (objects that do not verify, each named; a symlink or special file)."""
    if not (source / layout.OBJECTS).is_dir() or (source / layout.OBJECTS).is_symlink():
        why = f"no registry at {source} (no {layout.MARKER}, no {layout.OBJECTS}/ directory)"
        raise RegistryLocationError(why, hint=f"see {layout.FORMAT_DOC}")
    dirs, files = list_tree(source)
    bad, legacy = [], {}
    for rel in files:
        if progress is not None:
            progress(rel)
        top = rel.partition("/")[0]
        if top == layout.OBJECTS:
            sha = layout.object_sha(rel)
            if sha is None or sha256_file(source / rel, source) != sha:  # streamed: any size
                bad.append(f"{rel} ({'not an object file' if sha is None else 'hashes wrong'})")
        elif top in (layout.META, layout.MEASUREMENTS) and rel.endswith(".json"):
            raw = fsutil.read_nofollow(source / rel, root=source)
            if not _current_shape(rel, raw):
                legacy[rel] = hashlib.sha256(raw).hexdigest()
    if bad:
        rule = f"an object is the exact bytes its name hashes: {layout.FORMAT_DOC}"
        why = f"{source}: {len(bad)} objects do not verify, nothing adopted ({rule}): "
        raise IntegrityError(why + "; ".join(bad), path=source)
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
        for rel in [rel for rel in files if layout.object_sha(rel) is not None]:
            os.chmod(staging / rel, stat.S_IMODE((staging / rel).lstat().st_mode) & ~0o222)
        said = _tighten_modes(staging, ["", *dirs, *files])
        now = layout.iso_utc(layout.utc_now())
        manifest = {"format": f"{layout.FORMAT}-legacy", "version": 1, "adopted": now}
        manifest |= {"from": str(source), "records": legacy, "kept": kept}
        fsutil.publish_new(staging / layout.LEGACY, dumps_canonical(manifest) + b"\n")
        fsutil.publish_new(staging / layout.MARKER, layout.encode_marker("origin", now), mode=0o644)
        said += _journal_names(staging, given, now)
        repointed = repoint(staging, given, target, write=True)
        warnings = [*said, *check_verifies(Registry(staging), "the adopted registry")]
        staging.rename(target)  # replaces an empty target; one that gained files fails
    except BaseException:
        remove_tree(staging, ordered=False)
        raise
    fsutil.fsync_dir(target.parent)
    return warnings, repointed


def _tighten_modes(staging: Path, rels: Sequence[str]) -> list[str]:
    """Drop the write bits `verify` calls insecure (`modes.unsafe_write_bits`) from every
    adopted entry (a hand-built `bin/` script at 0777): what verify accepts; each said."""
    said = []
    for rel in rels:
        path = staging / rel if rel else staging
        st = path.lstat()
        if bits := unsafe_write_bits(st):
            mode = stat.S_IMODE(st.st_mode)
            path.chmod(mode & ~bits)
            who = "every user" if bits & stat.S_IWOTH else f"group {st.st_gid}"
            said.append(
                f"{rel or '.'}: was writable by {who} (mode {mode:04o}); adopted as "
                f"{mode & ~bits:04o}, as verify requires"
            )
    return said


def _journal_names(staging: Path, given: Path, now: str) -> list[str]:
    """A hand-built tree has names but no journal: write `names.log` whole, one line per
    name from nothing to its sha, so every name agrees with its journal; said. A tree that
    has a journal keeps it as it is."""
    from prefixreg.core.records import NameMove

    if os.path.lexists(staging / layout.NAMES_LOG):
        return []
    names = Registry(staging).names()  # refuses a name file that is not a sha line
    if not names:
        return []
    moves = (NameMove(at=now, name=n, from_sha=None, to_sha=sha) for n, sha in names.items())
    lines = b"".join(dumps_canonical(m.to_dict()) + b"\n" for m in moves)
    fsutil.publish_new(staging / layout.NAMES_LOG, lines, mode=0o644)
    return [
        f"{given} had names/ ({len(names)}) but no {layout.NAMES_LOG}: wrote one, a journal "
        "line per name (from none to its sha)"
    ]

"""Find the lines that still name an old registry path (`migrate --scan`). Read-only.

Invariants: only reads the user's own files (not a registry traversal); the walk is iterative
(any depth is safe) and never descends into a symlinked directory; binary files (a NUL byte in
the first 8 KiB), files over 8 MiB, VCS directories and the registries themselves are skipped.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from prefixreg.core.jsonio import JSONObject

_SKIP_DIRS: Final = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__"})
_MAX_BYTES: Final = 8 << 20


@dataclass(frozen=True, slots=True)
class StaleReference:
    """One line of a file that still names the old registry path."""

    path: str
    line: int
    text: str

    def to_dict(self) -> JSONObject:
        return asdict(self)


def _path_forms(old: Path) -> list[str]:
    """The spellings a config file might use for `old` (`~/`, `$HOME/`, systemd's `%h/`)."""
    forms = {str(old)}
    with contextlib.suppress(OSError):
        forms.add(str(old.resolve()))
    home = Path.home()
    for base in {home, home.resolve()}:
        with contextlib.suppress(ValueError):
            rel = old.relative_to(base)
            forms.update(f"{prefix}/{rel}" for prefix in ("~", "$HOME", "${HOME}", "%h"))
    return sorted(forms, key=len, reverse=True)


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


def scan_references(
    old: Path | str, dirs: Sequence[Path | str], *, skip: Sequence[Path | str] = ()
) -> list[StaleReference]:
    """Every file:line under `dirs` (directories or files) that still names `old`."""
    if not dirs:
        return []
    old = Path(old).expanduser().absolute()
    forms = _path_forms(old)
    # Not followed by another path-name character: `~/prefix-registry-old` is another path.
    pattern = re.compile("(?:" + "|".join(re.escape(f) for f in forms) + r")(?![\w-]|\.\w)")
    skipped = {Path(p).expanduser().resolve() for p in skip} | {old.resolve()}
    found: list[StaleReference] = []
    for start in map(Path, dirs):
        start = start.expanduser()
        for path in [start] if start.is_file() else _files(start, skipped):
            found.extend(_scan_file(path, pattern))
    return found


def _scan_file(path: Path, pattern: re.Pattern[str]) -> list[StaleReference]:
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BYTES:
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

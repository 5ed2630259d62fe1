"""Find the lines that still name an old registry path (`migrate --scan`). Read-only.

Invariants: only reads; symlinked directories are not descended into; binary files (a
NUL byte in the first 8 KiB), files over 8 MiB, VCS directories and the registries
themselves are skipped. Not a registry traversal: it reads the user's own files.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from prefixreg.core.jsonio import JSONObject

__all__ = ["StaleReference", "scan_references"]

_SCAN_SKIP_DIRS: Final = frozenset({".git", ".hg", ".svn", "node_modules", "__pycache__"})
_SCAN_MAX_BYTES: Final = 8 << 20


def _path_forms(old: Path) -> list[str]:
    """The spellings a config file might use for `old`."""
    forms = {str(old)}
    with contextlib.suppress(OSError):
        forms.add(str(old.resolve()))
    home = Path.home()
    for base in {home, home.resolve()}:
        try:
            rel = old.relative_to(base)
        except ValueError:
            continue
        for prefix in ("~", "$HOME", "${HOME}", "%h"):
            forms.add(f"{prefix}/{rel}")
    return sorted(forms, key=len, reverse=True)


def scan_references(
    old: Path | str, dirs: Sequence[Path | str], *, skip: Sequence[Path | str] = ()
) -> list[StaleReference]:
    """Every file:line under `dirs` that still names the registry path `old`.

    Symlinked directories are not descended into; binary files (a NUL byte in the first
    8 KiB), files over 8 MiB, VCS directories and the registries themselves are skipped.
    """
    if not dirs:
        return []
    old = Path(old).expanduser().absolute()
    forms = _path_forms(old)
    # Not followed by another path-name character: `~/prefix-registry-old` is another path.
    pattern = re.compile("(?:" + "|".join(re.escape(f) for f in forms) + r")(?![\w-]|\.\w)")
    skip_real = {Path(p).expanduser().resolve() for p in skip} | {old.resolve()}
    found: list[StaleReference] = []
    for start in dirs:
        start_path = Path(start).expanduser()
        if start_path.is_file():
            found.extend(_scan_file(start_path, pattern))
            continue
        for directory, dirnames, filenames in os.walk(start_path):
            base = Path(directory)
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in _SCAN_SKIP_DIRS and (base / d).resolve() not in skip_real
            )
            for name in sorted(filenames):
                found.extend(_scan_file(base / name, pattern))
    return found


def _scan_file(path: Path, pattern: re.Pattern[str]) -> list[StaleReference]:
    try:
        if not path.is_file() or path.stat().st_size > _SCAN_MAX_BYTES:
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


@dataclass(frozen=True, slots=True)
class StaleReference:
    """One line of a file that still names the old registry path."""

    path: str
    line: int
    text: str

    def to_dict(self) -> JSONObject:
        return {"path": self.path, "line": self.line, "text": self.text}

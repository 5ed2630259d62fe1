"""Frame records on disk (`frames/<sha>.json`): a part of `Registry`, like `Records`.

A frame record (format: `prefixreg.core.frame`) names a system prefix and a tools object by
their shas; both are ordinary objects, so `verify`, `gc` and the mirror treat them like any
prefix. The record is published once (mode 0444) under the sha of its exact bytes.
`Registry.add_frame` writes one and `Registry.head` / `Registry.frame` read one (the one
resolver); this part knows only the disk, never the registry above it.

Invariants:
- `read` re-hashes the record and every part it names, and parses the tools once, before it
  returns a `Frame`; a mismatch, a missing part or a record out of canonical form raises
  `IntegrityError`, so nothing is sent. Records are read with the depth-capped JSON reader
  (a record nested 100k deep is a bad record, never a crash), never through a link.
- Write order (in `Registry.add_frame`): parts (objects), then the record, then the name: a
  crash leaves at worst an unnamed record or object, never a name whose frame or part is
  missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import IntegrityError, RefNotFoundError, UsageError
from prefixreg.core.frame import Frame, parse_frame_record
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.core.prefix import Prefix
from prefixreg.registry import fsutil, layout
from prefixreg.registry.disk import Disk
from prefixreg.registry.objects import ObjectInfo, Objects


class Frames:
    """The frame records below a `Disk`, their parts read through `Objects`."""

    def __init__(self, disk: Disk, objects: Objects) -> None:
        self._disk = disk
        self._objects = objects

    def shas(self) -> list[str]:
        """Every frame sha present (by file name; not verified), sorted."""
        entries = self._disk.entries(layout.FRAMES)
        shas = (layout.frame_sha(f"{layout.FRAMES}/{e}") for e, kind in entries if kind == "file")
        return [sha for sha in shas if sha is not None]

    def publish(self, raw: bytes) -> str:
        """Publish record bytes under their sha (an existing record is re-verified, never
        trusted); returns the sha."""
        sha = sha256_hex(raw)
        if not fsutil.publish_new(self._disk.mkdir(layout.FRAMES) / f"{sha}.json", raw, mode=0o444):
            self.read(sha)
        return sha

    def _parse(self, sha: str) -> tuple[str, str | None, dict[str, Any]]:
        """(system, tools, settings) of record `sha`, its bytes re-hashed; errors name the path."""
        rel = layout.frame_relpath(sha)
        path = self._disk.path(rel)
        try:
            return parse_frame_record(sha, self._disk.read(rel))
        except FileNotFoundError:
            raise RefNotFoundError(f"no frame {sha}") from None
        except IntegrityError as exc:
            where = f"{path}: {exc}"
            raise type(exc)(where, path=path, expected=exc.expected, actual=exc.actual) from None

    def read(self, sha: str, *, name: str | None = None) -> Frame:
        """The verified frame `sha` (see the module invariants). Raises: RefNotFoundError (no
        such frame), IntegrityError (the record or a part fails verification, or is missing)."""
        system_sha, tools_sha, settings = self._parse(layout.need_sha(sha))
        path = self._disk.path(layout.frame_relpath(sha))
        try:
            system = Prefix(system_sha, self._objects.read(system_sha))
            tools = None if tools_sha is None else self._objects.read(tools_sha)
            return Frame(sha, system, tools_sha, tools, dumps_canonical(settings), name=name)
        except RefNotFoundError as exc:
            raise IntegrityError(f"frame {sha}: a part is missing ({exc})", path=path) from None
        except UsageError as exc:  # the tools do not parse (once, as the frame is built)
            raise IntegrityError(f"frame {sha}: {exc}", path=path) from None

    def _checked(self) -> dict[str, tuple[str, str | None] | str]:
        """Every frame record: its (system, tools) shas, or why it cannot be read."""
        out: dict[str, tuple[str, str | None] | str] = {}
        for sha in self.shas():
            try:
                out[sha] = self._parse(sha)[:2]
            except (OSError, RefNotFoundError, IntegrityError) as exc:
                out[sha] = str(exc)
        return out

    def parts(self) -> set[str]:
        """The object shas the frame records name (system and tools), for gc. Raises
        `IntegrityError` for a record that does not parse: gc must not guess what it keeps."""
        out: set[str] = set()
        for sha, parts in self._checked().items():
            if isinstance(parts, str):
                path = self._disk.path(layout.frame_relpath(sha))
                why = f"{path}: cannot tell which objects this frame keeps ({parts}); refused"
                raise IntegrityError(why, path=path)
            out.update(p for p in parts if p is not None)
        return out

    def problems(self) -> list[tuple[str, str]]:
        """(relative path, problem) for every frame record that fails `read`."""
        problems = []
        for sha in self.shas():
            try:
                self.read(sha)
            except (IntegrityError, RefNotFoundError) as exc:
                problems.append((layout.frame_relpath(sha), str(exc)))
        return problems

    def rows(self, by_sha: Mapping[str, list[str]]) -> list[ObjectInfo]:
        """`ls` rows of the frame records: the record's age, its parts as the note."""
        rows = []
        for sha, parts in self._checked().items():
            st = self._disk.lstat(layout.frame_relpath(sha))
            if isinstance(parts, str):
                note = "a record that does not verify (run prefixreg verify)"
            else:
                note = f"system {parts[0][:12]}" + (f" tools {parts[1][:12]}" if parts[1] else "")
            created = None if st is None else layout.iso_utc(st.st_mtime)
            names = tuple(sorted(by_sha.get(sha, ())))
            rows.append(ObjectInfo(sha, None, created, note, names, kind="frame"))
        return rows

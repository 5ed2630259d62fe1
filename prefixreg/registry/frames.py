"""Frame records on disk: `frames/<sha>.json`, written once, read verified, checked for gc.

A frame record (format: `prefixreg.core.frame`) names a system prefix and a tools object by
their shas; both are ordinary objects, so `verify`, `gc` and the mirror treat them like any
prefix. The record is published once (mode 0444) under the sha of its exact bytes.
References resolve through `Registry.head` (the one resolver); `get_frame` and `get_head`
are its thin forms.

Invariants:
- `read_frame` re-hashes the record and every part it names, and parses the tools once,
  before it returns a `Frame`; a mismatch, a missing part or a record out of canonical form
  raises `IntegrityError`, so nothing is sent. Records are read with the depth-capped JSON
  reader (a record nested 100k deep is a bad record, never a crash), never through a link.
- Write order: parts (objects), then the record, then the name: a crash leaves at worst an
  unnamed record or object, never a name whose frame or part is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import IntegrityError, RefNotFoundError, UsageError
from prefixreg.core.frame import Frame, encode_frame_record, parse_frame_record, parse_tools
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.registry import fsutil, layout

if TYPE_CHECKING:
    from prefixreg.core.prefix import Prefix
    from prefixreg.registry.objects import ObjectInfo
    from prefixreg.registry.store import Registry


def _registry(reg: object) -> Registry:
    from prefixreg.registry.store import Registry

    if not isinstance(reg, Registry):
        raise UsageError(f"not a Registry: {type(reg).__name__}")
    return reg


def is_frame(reg: Registry, sha: str) -> bool:
    """Whether `frames/<sha>.json` exists (not verified)."""
    return _registry(reg)._names.is_frame(sha)


def frame_shas(reg: Registry) -> list[str]:
    """Every frame sha present (by file name; not verified), sorted."""
    entries = _registry(reg)._disk.entries(layout.FRAMES)
    shas = (layout.frame_sha(f"{layout.FRAMES}/{e}") for e, kind in entries if kind == "file")
    return [sha for sha in shas if sha is not None]


def write_frame(
    reg: Registry,
    system: str,
    *,
    tools: str | bytes | None = None,
    settings: Mapping[str, object] | None = None,
    name: str | None = None,
    note: str | None = None,
    force: bool = False,
) -> str:
    """Register a frame and return its sha (idempotent): `system` is a reference to the system
    prefix (verified first), `tools` the tools JSON text (stored as its exact bytes: a list of
    tool objects), `settings` the prompt settings (`core.frame.PROMPT_SETTINGS`); `name`
    optionally points at it (a journalled move; one that holds a prefix moves only with
    `force`).

    Raises:
        UsageError: bad tools JSON, an unknown setting, a bad name or argument, or a mirror.
        IntegrityError: a part, or an existing record of the same sha, does not verify.
    """
    reg = _registry(reg)
    if name is not None:
        layout.validate_name(name)
    given: tuple[object, object] = (tools, settings)  # the API boundary: anything may come
    if not isinstance(given[0], str | bytes | None) or not isinstance(given[1], Mapping | None):
        raise UsageError("tools must be JSON text (str or bytes) and settings a mapping")
    reg.init()
    reg.refuse_on_mirror("register a frame")
    system_sha = reg.get(system).sha256  # verified
    tools_sha = None
    if tools is not None:
        data = tools.encode("utf-8") if isinstance(tools, str) else tools
        parse_tools(data)
        tools_sha = reg.add(data, source="tools", note=note)
    raw = encode_frame_record(system_sha, tools_sha, settings or {})
    sha = sha256_hex(raw)
    if not fsutil.publish_new(reg._disk.mkdir(layout.FRAMES) / f"{sha}.json", raw, mode=0o444):
        read_frame(reg, sha)  # an existing record is re-verified, never trusted
    if name is not None:
        reg.move_name(name, sha, force=force)
    return sha


def _parse(reg: Registry, sha: str) -> tuple[str, str | None, dict[str, Any]]:
    """(system, tools, settings) of record `sha`, its bytes re-hashed; errors name the path."""
    rel = layout.frame_relpath(sha)
    path = reg._disk.path(rel)
    try:
        return parse_frame_record(sha, reg._disk.read(rel))
    except FileNotFoundError:
        raise RefNotFoundError(f"no frame {sha}") from None
    except IntegrityError as exc:
        where = f"{path}: {exc}"
        raise type(exc)(where, path=path, expected=exc.expected, actual=exc.actual) from None


def read_frame(reg: Registry, sha: str, *, name: str | None = None) -> Frame:
    """The verified frame `sha` (see the module invariants). Raises: RefNotFoundError (no
    such frame), IntegrityError (the record or a part fails verification, or is missing)."""
    reg = _registry(reg)
    system_sha, tools_sha, settings = _parse(reg, layout.need_sha(sha))
    path = reg._disk.path(layout.frame_relpath(sha))
    try:
        system = reg.get(system_sha)
        tools_data = None if tools_sha is None else reg.read_verified(tools_sha)
        return Frame(sha, system, tools_sha, tools_data, dumps_canonical(settings), name=name)
    except RefNotFoundError as exc:
        raise IntegrityError(f"frame {sha}: a part is missing ({exc})", path=path) from None
    except UsageError as exc:  # the tools do not parse (once, as the frame is built)
        raise IntegrityError(f"frame {sha}: {exc}", path=path) from None


def get_frame(reg: Registry, ref: str) -> Frame:
    """The verified frame `ref` names (`Registry.head`, refusing a prefix with
    `RefNotFoundError`; otherwise raising as `head`)."""
    head = _registry(reg).head(ref)
    if not isinstance(head, Frame):
        raise RefNotFoundError(f"no frame {ref!r} ({head.sha256[:12]} is a prefix)")
    return head


def get_head(reg: Registry, ref: str) -> Frame | Prefix:
    """`Registry.head(ref)`: the verified frame or prefix `ref` names."""
    return _registry(reg).head(ref)


def _checked(reg: Registry) -> dict[str, tuple[str, str | None] | str]:
    """Every frame record: its (system, tools) shas, or why it cannot be read."""
    out: dict[str, tuple[str, str | None] | str] = {}
    for sha in frame_shas(reg):
        try:
            out[sha] = _parse(reg, sha)[:2]
        except (OSError, RefNotFoundError, IntegrityError) as exc:
            out[sha] = str(exc)
    return out


def frame_parts(reg: Registry) -> set[str]:
    """The object shas the frame records name (system and tools), for gc. Raises
    `IntegrityError` for a record that does not parse: gc must not guess what it keeps."""
    out: set[str] = set()
    for sha, parts in _checked(reg).items():
        if isinstance(parts, str):
            path = reg._disk.path(layout.frame_relpath(sha))
            why = f"{path}: cannot tell which objects this frame keeps ({parts}); refused"
            raise IntegrityError(why, path=path)
        out.update(p for p in parts if p is not None)
    return out


def verify_frames(reg: Registry) -> list[tuple[str, str]]:
    """(relative path, problem) for every frame record that fails `read_frame`."""
    problems = []
    for sha in frame_shas(reg):
        try:
            read_frame(reg, sha)
        except (IntegrityError, RefNotFoundError) as exc:
            problems.append((layout.frame_relpath(sha), str(exc)))
    return problems


def frame_rows(reg: Registry, by_sha: Mapping[str, list[str]]) -> list[ObjectInfo]:
    """`ls` rows of the frame records: the record's age, its parts as the note."""
    from prefixreg.registry.objects import ObjectInfo

    rows = []
    for sha, parts in _checked(reg).items():
        st = reg._disk.lstat(layout.frame_relpath(sha))
        if isinstance(parts, str):
            note = "a record that does not verify (run prefixreg verify)"
        else:
            note = f"system {parts[0][:12]}" + (f" tools {parts[1][:12]}" if parts[1] else "")
        created = None if st is None else layout.iso_utc(st.st_mtime)
        names = tuple(sorted(by_sha.get(sha, ())))
        rows.append(ObjectInfo(sha, None, created, note, names, kind="frame"))
    return rows

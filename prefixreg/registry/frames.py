"""Frames on disk: `frames/<sha>.json`, write, resolve, read verified, name, check.

A frame record (format: `prefixreg.core.frame`) names a system prefix and a tools object by
their shas; both are ordinary objects (`objects/<aa>/<sha>.txt`, exact bytes, with meta), so
`verify`, `gc` and the mirror treat them like any prefix. The record itself is published
once, never rewritten (mode 0444), under the sha of its exact bytes.

Invariants:
- `read_frame` re-hashes the record and every part it names before it returns a `Frame`;
  a mismatch, a missing part or a record out of canonical form raises `IntegrityError`
  (so nothing is sent). Reads never follow a symlink below the root.
- A name may point at a frame as it points at a prefix (`names/<name>`, journalled in
  `names.log`, the journal line durable before the name file changes).
- Write order: parts (objects), then the record, then the name: a crash leaves at worst an
  unnamed record or object, never a name whose frame or part is missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from prefixreg.core.digest import is_full_sha, sha256_hex
from prefixreg.core.errors import (
    AmbiguousRefError,
    IntegrityError,
    RefNotFoundError,
    UsageError,
)
from prefixreg.core.frame import Frame, encode_frame_record, parse_frame_record, parse_tools
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.registry import fsutil
from prefixreg.registry.layout import (
    FRAMES,
    frame_relpath,
    frame_sha,
    name_relpath,
    validate_name,
)

if TYPE_CHECKING:
    from prefixreg.core.prefix import Prefix
    from prefixreg.core.records import NameMove
    from prefixreg.registry.store import Registry

__all__ = [
    "frame_parts",
    "frame_shas",
    "get_frame",
    "get_head",
    "is_frame",
    "name_frame",
    "read_frame",
    "resolve_frame",
    "verify_frames",
    "write_frame",
]


def is_frame(reg: Registry, sha: str) -> bool:
    """Whether `frames/<sha>.json` exists (not verified)."""
    return reg.lstat(frame_relpath(sha)) is not None


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
    """Register a frame and return its sha (idempotent).

    Args:
        system: a reference to the system prefix (verified before anything is written).
        tools: the tools JSON text, stored as its exact bytes (a JSON list of tool objects).
        settings: the prompt settings (`core.frame.PROMPT_SETTINGS`).
        name: optionally point this name at the frame (a journalled move); a name that
            holds a prefix moves only with `force`.

    Raises:
        UsageError: bad tools JSON, an unknown setting, a bad name, or a mirror.
        IntegrityError: a part, or an existing record of the same sha, does not verify.
    """
    if name is not None:
        validate_name(name)
    reg.init()
    reg.refuse_on_mirror("register a frame")
    system_sha = reg.get(system).sha256  # verified
    tools_sha = None
    if tools is not None:
        data = tools.encode("utf-8") if isinstance(tools, str) else bytes(tools)
        parse_tools(data)
        tools_sha = reg.add(data, source="tools", note=note)
    raw = encode_frame_record(system_sha, tools_sha, settings or {})
    sha = sha256_hex(raw)
    path = reg.writable_dir(FRAMES) / frame_relpath(sha).rsplit("/", 1)[1]
    if not fsutil.publish_new(path, raw, mode=0o444):
        read_frame(reg, sha)  # an existing record is re-verified, never trusted
    if name is not None:
        name_frame(reg, name, sha, force=force)
    return sha


def read_frame(reg: Registry, sha: str, *, name: str | None = None) -> Frame:
    """The verified frame `sha`: record and parts re-hashed, tools parsed.

    Raises:
        RefNotFoundError: no such frame. IntegrityError: the record or a part fails
            verification, or a part is missing (nothing may be sent).
    """
    path = reg.path(frame_relpath(sha))
    try:
        raw = reg.read_file(frame_relpath(sha))
    except FileNotFoundError:
        raise RefNotFoundError(f"no frame {sha}") from None
    try:
        system_sha, tools_sha, settings = parse_frame_record(sha, raw)
    except IntegrityError as exc:
        raise type(exc)(
            f"{path}: {exc}", path=path, expected=exc.expected, actual=exc.actual
        ) from None
    try:
        system = reg.get(system_sha)
        tools_data = None if tools_sha is None else reg.read_verified(tools_sha)
    except RefNotFoundError as exc:
        raise IntegrityError(f"frame {sha}: a part is missing ({exc})", path=path) from None
    if tools_data is not None:
        try:
            parse_tools(tools_data, where=f"tools {tools_sha}")
        except UsageError as exc:
            raise IntegrityError(f"frame {sha}: {exc}", path=path) from None
    return Frame(
        sha256=sha,
        system=system,
        tools_sha256=tools_sha,
        tools_data=tools_data,
        settings_json=dumps_canonical(settings),
        name=name,
    )


def frame_shas(reg: Registry) -> list[str]:
    """Every frame sha present (by file name; not verified), sorted."""
    out = []
    for entry, kind in reg.entries(FRAMES):
        sha = frame_sha(f"{FRAMES}/{entry}")
        if kind == "file" and sha is not None:
            out.append(sha)
    return out


def resolve_frame(reg: Registry, ref: str) -> tuple[str, str | None] | None:
    """(frame sha, the name it was reached by) when `ref` names a frame, else None.

    A name, a full sha or an unambiguous 8+ hex abbreviation of a frame's sha.

    Raises:
        AmbiguousRefError: an abbreviation matching several frames.
    """
    if is_full_sha(ref):
        return (ref, None) if is_frame(reg, ref) else None
    try:
        name_relpath(ref)
        target = reg.read_name(ref)
    except UsageError:
        target = None
    if target is not None:
        return (target, ref) if is_frame(reg, target) else None
    low = ref.lower()
    if len(ref) >= 8 and all(c in "0123456789abcdef" for c in low):
        matches = [sha for sha in frame_shas(reg) if sha.startswith(low)]
        if len(matches) > 1:
            raise AmbiguousRefError(f"{ref!r} matches {len(matches)} frames", candidates=matches)
        if matches:
            return matches[0], None
    return None


def get_frame(reg: Registry, ref: str) -> Frame:
    """The verified frame `ref` names.

    Raises:
        RefNotFoundError: `ref` names no frame. IntegrityError: see `read_frame`.
    """
    found = resolve_frame(reg, ref)
    if found is None:
        raise RefNotFoundError(f"no frame {ref!r}")
    return read_frame(reg, found[0], name=found[1])


def get_head(reg: Registry, ref: str) -> Frame | Prefix:
    """The verified frame `ref` names, else the verified prefix it names (what `warm` and
    `keepalive` send as the head). Raises what `get_frame` or `Registry.get` raise."""
    return get_frame(reg, ref) if resolve_frame(reg, ref) is not None else reg.get(ref)


def name_frame(reg: Registry, name: str, sha: str, *, force: bool = False) -> NameMove | None:
    """Point `name` at frame `sha` (verified first, and again under the lock); the move is
    journalled like any name move (the `names.log` line durable before the name file).

    Returns the move, or None when the name already pointed there.
    """
    return reg.point_name(name, sha, check=lambda: read_frame(reg, sha), force=force)


def frame_parts(reg: Registry) -> set[str]:
    """The object shas the frame records name (system and tools), for gc.

    Raises:
        IntegrityError: a frame record that cannot be read or does not parse: gc must not
            guess which objects it keeps (verify reports the record).
    """
    out: set[str] = set()
    for sha in frame_shas(reg):
        rel = frame_relpath(sha)
        try:
            system, tools, _ = parse_frame_record(sha, reg.read_file(rel))
        except (OSError, IntegrityError) as exc:
            path = reg.path(rel)
            raise IntegrityError(
                f"{path}: cannot tell which objects this frame keeps ({exc}); refused",
                path=path,
            ) from None
        out.add(system)
        if tools is not None:
            out.add(tools)
    return out


def verify_frames(reg: Registry) -> list[tuple[str, str]]:
    """(relative path, problem) for every frame record that fails `read_frame`."""
    problems = []
    for sha in frame_shas(reg):
        try:
            read_frame(reg, sha)
        except (IntegrityError, RefNotFoundError) as exc:
            problems.append((frame_relpath(sha), str(exc)))
    return problems

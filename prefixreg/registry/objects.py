"""`Objects` and `Frames`: the objects, meta and frame records of a registry, verified at use.

Invariants:
- Every read of an object re-hashes the bytes it returns; a mismatch raises `IntegrityError`
  and nothing is returned. No flag skips it.
- Content is non-empty bytes or str of valid UTF-8 (it travels as a JSON string).
- Objects are published with no-overwrite links, never rewritten; publishing existing content
  re-verifies it and refreshes its mtime (age-based gc sees it used). A meta record is
  written after its object.
- Listing never follows a symlink: a symlinked `objects/` or fan-out directory, or (when
  asked) an object entry that is not a regular file, raises `IntegrityError`.
- Probe slices are objects whose meta `source` is `probe/<run id>` (reserved: `add` refuses
  it; a CLI label, a file's base name, has no `/`), or (earlier releases) `probe` with a note
  `probe ...`. A user's add of the same bytes makes the meta record theirs; a probe never
  rewrites one.
- A frame record (`frames/<sha>.json`, format `prefixreg.core.frame`) names a system prefix
  and a tools object, both ordinary objects; it is published once (0444) under the sha of
  its bytes, after its parts, before its name. `Frames.read` re-hashes the record and every
  part and parses the tools once; a mismatch, a missing part or a non-canonical record
  raises `IntegrityError`, so nothing is sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from prefixreg.core import errors
from prefixreg.core.digest import sha256_hex
from prefixreg.core.frame import Frame, parse_frame_record
from prefixreg.core.jsonio import dumps_canonical, loads_flat
from prefixreg.core.prefix import Prefix
from prefixreg.registry import fsutil, layout
from prefixreg.registry.disk import Disk, LegacyRecordError

if TYPE_CHECKING:
    from prefixreg.core.records import Meta

PROBE_SOURCE_PREFIX: Final = "probe/"


def is_probe_source(source: str, note: str | None = None) -> bool:
    """Does a meta record with this `source` (and `note`) mark a probe slice?"""
    legacy = source == "probe" and (note or "").startswith("probe ")
    return source.startswith(PROBE_SOURCE_PREFIX) or legacy


class ObjectInfo(NamedTuple):
    """One row of `ls`: an object (from its meta record) or a frame, and its names."""

    sha256: str
    bytes: int | None
    created: str | None
    note: str | None
    names: tuple[str, ...]
    probe_slice: bool = False  # registered by a probe, not the user's
    kind: str = "prefix"  # or "frame"


def check_text(value: object, what: str) -> str:
    """`value` if it is a str that encodes as UTF-8 (no lone surrogates), else `UsageError`."""
    if not isinstance(value, str):
        raise errors.UsageError(f"{what} must be text, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        why = f"{what} is not valid UTF-8 text (lone surrogate at character {exc.start})"
        raise errors.UsageError(why) from None
    return value


def content_bytes(content: object) -> bytes:
    """Prefix content as bytes, else `InvalidContentError` (see the module invariants)."""
    if isinstance(content, bytes | bytearray | memoryview):
        data = bytes(content)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise errors.InvalidContentError(
                f"content is not valid UTF-8 (byte {exc.start}): a prefix travels as a JSON string"
            ) from None
    elif isinstance(content, str):
        data = check_text(content, "content").encode("utf-8")
    else:
        kind = type(content).__name__
        raise errors.InvalidContentError(f"content must be bytes or str, not {kind}")
    if not data:
        raise errors.InvalidContentError("refusing to add an empty prefix")
    return data


class Objects:
    """Objects and meta records below a `Disk`."""

    def __init__(self, disk: Disk) -> None:
        self._disk = disk

    def read(self, sha: str) -> bytes:
        """The verified bytes of object `sha` (checked by the caller). Raises: RefNotFoundError;
        IntegrityError (a mismatch, a symlink, not a regular file)."""
        try:
            data = fsutil.read_below(self._disk.root_s, layout.object_relpath_trusted(sha))
        except FileNotFoundError:
            raise errors.RefNotFoundError(f"no prefix {sha}") from None
        if hashlib.sha256(data).hexdigest() != sha:  # inline: every verified get pays this
            self.check(sha, data)
        return data

    def check(self, sha: str, data: bytes) -> None:
        """Raise `IntegrityError` unless `data` hashes to `sha` (the bytes of its object)."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            path = self._disk.path(layout.object_relpath_trusted(sha))
            why = f"{path}: content hashes to {actual}, expected {sha}; refusing to use it"
            raise errors.IntegrityError(why, path=path, expected=sha, actual=actual)

    def meta(self, sha: str) -> Meta:
        """The meta record of `sha`. Raises: RefNotFoundError; CorruptRecordError."""
        rel = layout.meta_relpath(sha)
        try:
            raw = self._disk.read(rel)
        except FileNotFoundError:
            raise errors.RefNotFoundError(f"no meta record for {sha}") from None
        return self.parse_meta(sha, raw)

    def metas(self, shas: Iterable[str]) -> dict[str, Meta]:
        """The meta records of those of `shas` that have one, read through one descriptor of
        `meta/` (`ls` reads them all). Raises: CorruptRecordError; IntegrityError."""
        out: dict[str, Meta] = {}
        files = (f"{sha}.json" for sha in shas)
        try:
            with contextlib.closing(self._disk.read_each(layout.META, files)) as each:
                for name, got in each:
                    if isinstance(got, FileNotFoundError):
                        continue
                    if isinstance(got, Exception):
                        raise got
                    out[name[:-5]] = self.parse_meta(name[:-5], got[0])
        except FileNotFoundError:  # no meta/ at all: no object has a record
            pass
        return out

    def parse_meta(self, sha: str, raw: bytes) -> Meta:
        """The meta record of `sha` from its bytes. Raises: CorruptRecordError."""
        from prefixreg.core.records import Meta

        if (meta := Meta.from_flat(loads_flat(raw), sha)) is not None:
            return meta  # the shape `add` writes, read without the general reader's walk
        rel = layout.meta_relpath(sha)
        try:
            meta = self._disk.record(rel, Meta.from_dict, raw)
        except LegacyRecordError:  # history in its own shape: what the object itself says
            st = self._disk.lstat(layout.object_relpath(sha))
            size, moment = (st.st_size, st.st_mtime) if st is not None else (0, 0.0)
            return Meta(sha256=sha, bytes=size, created=layout.iso_utc(moment), source="legacy")
        if meta.sha256 != sha:
            path = self._disk.path(rel)
            raise errors.CorruptRecordError(f"{path}: records sha {meta.sha256}", path=path)
        return meta

    def legacy_records(self, sha: str) -> list[tuple[str, bytes]]:
        """The adopted registry's own records of object `sha` (its meta record, and each
        other one `legacy.json` lists that names the sha in its path or its bytes), still
        byte-identical to what it lists: (relative path, bytes), by path. Raises:
        CorruptRecordError (a legacy manifest that does not parse); IntegrityError."""
        out = []
        for rel in sorted(self._disk.legacy()[0]):
            try:
                raw = self._disk.read(rel)
            except FileNotFoundError:
                continue
            mine = rel == layout.meta_relpath(sha) or sha in rel or sha.encode() in raw
            if mine and self._disk.is_legacy(rel, raw):  # a changed one is verify's problem
                out.append((rel, raw))
        return out

    def shas(self, *, regular_only: bool = False, prefix: str = "") -> Iterator[str]:
        """Object shas starting with `prefix`, by file name (unverified). Raises: IntegrityError."""
        fans = [prefix[:2]] if len(prefix) >= 2 else []
        for fan, kind in [] if fans else self._disk.entries(layout.OBJECTS):
            if kind == "link":
                where = self._disk.path(f"{layout.OBJECTS}/{fan}")
                raise errors.IntegrityError(f"{where}: is a symlink; refused", path=where)
            if kind == "dir" and not layout.is_temp_name(fan):
                fans.append(fan)
        for fan in fans:
            for entry, kind in self._disk.entries(f"{layout.OBJECTS}/{fan}"):
                m = layout.OBJECT_FILE.fullmatch(entry)  # `object_sha`, one match an entry
                if m is not None and m[2] == fan and (sha := m[1]).startswith(prefix):
                    if regular_only and kind != "file":
                        where = self._disk.path(f"{layout.OBJECTS}/{fan}/{entry}")
                        raise errors.IntegrityError(f"{where}: not a regular file", path=where)
                    yield sha

    def put(self, sha: str, data: bytes) -> None:
        """Publish `data` as object `sha`, or re-verify and refresh the one already there."""
        rel = layout.object_relpath(sha)
        path = self._disk.mkdir(rel.rsplit("/", 1)[0]) / rel.rsplit("/", 1)[1]
        for attempt in range(3):
            # Look before writing: re-adding known content (the common case in a loop) then
            # costs a read and a hash, not a durable write; publish_new settles races.
            if not os.path.lexists(path) and fsutil.publish_new(path, data, mode=0o444):
                return
            try:
                self.read(sha)  # never trust what is already there
                os.utime(path, follow_symlinks=False)
                return
            except (errors.RefNotFoundError, FileNotFoundError):
                # A concurrent `gc --prune-unnamed` removed it between our look and the
                # refresh: publish it again rather than fail or return a missing sha.
                if attempt == 2:
                    raise

    def write_meta(self, sha: str, size: int, *, note: str | None, source: str) -> None:
        """Write an object's meta; an existing one only gets a new note or becomes the user's."""
        path = self._disk.mkdir(layout.META) / f"{sha}.json"
        record: dict[str, object] = {"sha256": sha, "bytes": size, "source": source, "note": note}
        if not os.path.lexists(path):  # meta/ was just checked
            created = {"created": layout.iso_utc(layout.utc_now())}
            if fsutil.publish_new(path, dumps_canonical(record | created) + b"\n"):
                return
        if source.startswith(PROBE_SOURCE_PREFIX):
            return
        old = self.meta(sha)
        if not is_probe_source(old.source, old.note):
            if note is None or old.note == note:
                return
            if self._disk.is_legacy(layout.meta_relpath(sha)):  # history stays byte-identical
                why = f"{path}: a legacy record of the adopted registry, kept as it is"
                raise errors.UsageError(f"{why}; its note cannot change")
            record = {**old.to_dict(), "note": note}
        record["created"] = old.created
        fsutil.replace_atomic(path, dumps_canonical(record) + b"\n", mode=0o444)


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
        """Publish record bytes under their sha; an existing record is re-verified and its
        mtime refreshed (gc ages an unnamed frame by it: re-registered, it is used now). The
        sha. A record gc removes between the look and the refresh is published again."""
        sha = sha256_hex(raw)
        path = self._disk.mkdir(layout.FRAMES) / f"{sha}.json"
        for attempt in range(3):
            try:
                if not fsutil.publish_new(path, raw, mode=0o444):
                    self.read(sha)
                    os.utime(path, follow_symlinks=False)
                return sha
            except (errors.RefNotFoundError, FileNotFoundError):
                if attempt == 2:  # removed under us three times running: say so
                    raise
        raise AssertionError("unreachable")

    def _parse(self, sha: str) -> tuple[str, str | None, dict[str, Any], str | None]:
        """(system, tools, settings, leading messages) of record `sha`, its bytes re-hashed;
        errors name the path."""
        rel = layout.frame_relpath(sha)
        path = self._disk.path(rel)
        try:
            return parse_frame_record(sha, self._disk.read(rel))
        except FileNotFoundError:
            raise errors.RefNotFoundError(f"no frame {sha}") from None
        except errors.IntegrityError as exc:
            where = f"{path}: {exc}"
            raise type(exc)(where, path=path, expected=exc.expected, actual=exc.actual) from None

    def read(self, sha: str, *, name: str | None = None) -> Frame:
        """The verified frame `sha`. Raises: RefNotFoundError (no such frame), IntegrityError
        (the record or a part fails verification, or is missing)."""
        system_sha, tools_sha, settings, lead_sha = self._parse(layout.need_sha(sha))
        path = self._disk.path(layout.frame_relpath(sha))
        try:
            system = Prefix(system_sha, self._objects.read(system_sha))
            tools = None if tools_sha is None else self._objects.read(tools_sha)
            lead = None if lead_sha is None else self._objects.read(lead_sha)
            return Frame(
                sha, system, tools_sha, tools, dumps_canonical(settings), name, lead_sha, lead
            )
        except errors.RefNotFoundError as exc:
            why = f"a part is missing ({exc})"
        except errors.UsageError as exc:  # the tools do not parse (once, as the frame is built)
            why = str(exc)
        raise errors.IntegrityError(f"frame {sha}: {why}", path=path) from None

    def checked(self) -> dict[str, tuple[str, str | None, str | None] | str]:
        """Every frame record: its (system, tools, leading messages) shas, or why it cannot
        be read."""
        out: dict[str, tuple[str, str | None, str | None] | str] = {}
        for sha in self.shas():
            try:
                system, tools, _, lead = self._parse(sha)
                out[sha] = (system, tools, lead)
            except (OSError, errors.RefNotFoundError, errors.IntegrityError) as exc:
                out[sha] = str(exc)
        return out

    def parts(self) -> set[str]:
        """The object shas the frame records name, for gc. Raises `IntegrityError` for a
        record that does not parse: gc must not guess what it keeps."""
        out: set[str] = set()
        for sha, parts in self.checked().items():
            if isinstance(parts, str):
                path = self._disk.path(layout.frame_relpath(sha))
                why = f"{path}: cannot tell which objects this frame keeps ({parts}); refused"
                raise errors.IntegrityError(why, path=path)
            out.update(p for p in parts if p is not None)
        return out

    def problems(self) -> list[tuple[str, str]]:
        """(relative path, problem) for every frame record that fails `read`."""
        problems = []
        for sha in self.shas():
            try:
                self.read(sha)
            except (errors.IntegrityError, errors.RefNotFoundError) as exc:
                problems.append((layout.frame_relpath(sha), str(exc)))
        return problems

    def rows(self, by_sha: Mapping[str, list[str]]) -> list[ObjectInfo]:
        """`ls` rows of the frame records: the record's age, its parts as the note."""
        rows = []
        for sha, parts in self.checked().items():
            st = self._disk.lstat(layout.frame_relpath(sha))
            if isinstance(parts, str):
                note = "a record that does not verify (run prefixreg verify)"
            else:
                note = f"system {parts[0][:12]}" + (f" tools {parts[1][:12]}" if parts[1] else "")
                note += f" messages {parts[2][:12]}" if parts[2] else ""
            created = None if st is None else layout.iso_utc(st.st_mtime)
            names = tuple(sorted(by_sha.get(sha, ())))
            rows.append(ObjectInfo(sha, None, created, note, names, kind="frame"))
        return rows


def list_rows(
    objs: Objects, frames_part: Frames, by_sha: Mapping[str, list[str]], *, frames: bool
) -> list[ObjectInfo]:
    """`Registry.list_objects`' rows: objects, a frame's parts by their kind, `frames` too."""
    part_of: dict[str, tuple[str, list[str]]] = {}  # object -> (its kind, frames)
    for frame, parts in frames_part.checked().items():
        if isinstance(parts, str):
            continue
        for kind, part in (("tools", parts[1]), ("messages", parts[2])):
            if part is not None:
                part_of.setdefault(part, (kind, []))[1].append(frame[:12])
    out = []
    shas = list(objs.shas(regular_only=True))
    metas = objs.metas(shas)
    for sha in shas:
        names = tuple(sorted(by_sha.get(sha, ())))
        kind, frames_of = part_of.get(sha, ("prefix", []))
        held = f"{kind} of frame {', '.join(frames_of)}" if frames_of else None
        if (m := metas.get(sha)) is None:
            out.append(ObjectInfo(sha, None, None, held, names, kind=kind))
            continue
        slice_ = is_probe_source(m.source, m.note)
        note = "; ".join(n for n in (held, m.note) if n) or None
        out.append(ObjectInfo(sha, m.bytes, m.created, note, names, slice_, kind))
    if frames:
        out += frames_part.rows(by_sha)
    return sorted(out, key=lambda o: (o.created or "", o.sha256))

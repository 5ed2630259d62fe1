"""The registry on disk (`Registry`): add, list, and the records verbs keep there.

Layout (format version 1, DESIGN §3; the rules live in `prefixreg.registry.layout`)::

    REGISTRY.json  README.md  objects/<aa>/<sha256>.txt  meta/<sha256>.json
    names/<name>  names.log  measurements/<sha256>-<ts>.json  probes/  mirror.log  .locks/

`Registry` is assembled from one class per role: `disk.RegistryDisk` (root, marker, lock,
no-follow access), `objects.ObjectStore` (objects and meta, verify at use),
`names.NamedStore` (references and the write-ahead name journal), and this module (adding
a prefix, listing, measurements, probe receipts, the mirror log). Probe slices are
objects like any other, marked in their meta record (`probeslices` holds the convention).

Invariants:
- Arguments are checked before anything is written: content is bytes or str and valid
  UTF-8; a note and a source are str and valid UTF-8 text (no lone surrogates); a name
  obeys the name rule. A bad argument raises `UsageError` and writes nothing.
- Write order is object, then meta, then name: a crash can leave an object without meta
  (reported by `verify` as incomplete, repaired by adding again) or a temp file (a stray),
  never a meta record or a name whose object is missing.
- Records (measurements, probe receipts) are published with no-overwrite links, never
  through a symlinked directory; the store is the only code that writes them.
- This module never imports `verify`, `gc` or `migrate`: those are use cases built on the
  store's public API.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import (
    CorruptRecordError,
    InvalidContentError,
    PrefixregError,
    RefNotFoundError,
    UsageError,
)
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.clock import iso_utc, stamp_utc, utc_now
from prefixreg.registry.layout import FORMAT, FORMAT_VERSION, MARKER, NAME_RE, validate_name
from prefixreg.registry.names import NameConflictError, NamedStore
from prefixreg.registry.probeslices import PROBE_SOURCE_PREFIX, is_probe_source, probe_source

if TYPE_CHECKING:
    from prefixreg.core.frame import Frame
    from prefixreg.core.prefix import Prefix
    from prefixreg.core.records import Measurement, Meta

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MARKER",
    "NAME_RE",
    "NameConflictError",
    "ObjectInfo",
    "Registry",
    "check_text",
    "iso_utc",
    "stamp_utc",
    "utc_now",
    "validate_name",
]


class ObjectInfo(NamedTuple):
    """One object as `ls` shows it: from its meta record and the names pointing at it."""

    sha256: str
    bytes: int | None
    created: str | None
    note: str | None
    names: tuple[str, ...]
    probe_slice: bool = False  # registered by a probe (`probeslices`), not the user's


def check_text(value: object, what: str) -> str:
    """`value` if it is a str that encodes as UTF-8 (no lone surrogates), else `UsageError`."""
    if not isinstance(value, str):
        raise UsageError(f"{what} must be text, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(
            f"{what} is not valid UTF-8 text (undecodable byte or lone surrogate at "
            f"character {exc.start})"
        ) from None
    return value


def _content_bytes(content: object) -> bytes:
    if isinstance(content, str):
        try:
            return content.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidContentError(
                f"content is not valid UTF-8 text (lone surrogate at character {exc.start})"
            ) from None
    if isinstance(content, bytes | bytearray | memoryview):
        data = bytes(content)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidContentError(
                f"content is not valid UTF-8 (byte {exc.start}): a prefix travels as a JSON string"
            ) from None
        return data
    raise InvalidContentError(f"content must be bytes or str, not {type(content).__name__}")


class Registry(NamedStore):
    """A registry rooted at `root` (`Registry(root, lock_timeout=30.0)`; see
    `RegistryDisk` for the arguments and the location checks). Nothing is created until
    the first write."""

    def head(self, ref: str) -> Prefix | Frame:
        """The verified head `ref` names, resolved once: a frame (its record and parts
        re-hashed) or a prefix. What every verb sends.

        Raises:
            RefNotFoundError, AmbiguousRefError, InvalidDigestError: a bad reference.
            IntegrityError: the bytes, the record or a part fail verification.
        """
        from prefixreg.core.prefix import Prefix
        from prefixreg.registry.frames import read_frame

        sha, name = self._resolve(ref, frames=True)
        if self.lstat(layout.frame_relpath(sha)) is not None:
            return read_frame(self, sha, name=name)
        return Prefix(sha, self._read_verified(sha), name)

    # -- adding ---------------------------------------------------------------------------

    def add(
        self,
        content: bytes | str,
        *,
        name: str | None = None,
        note: str | None = None,
        source: str = "api",
    ) -> str:
        """Store `content` under its sha256 and return the sha (idempotent).

        Args:
            content: the exact prefix; bytes must be valid UTF-8.
            name: optionally point this name at the object (a journalled move).
            note: a free-text note kept in the meta record (UTF-8 text).
            source: a label saying where the content came from (a file name, "stdin").

        Raises:
            InvalidContentError: empty, not bytes or str, or not UTF-8.
            InvalidNameError: bad name. UsageError: a note or source that is not UTF-8
                text, or the registry is a mirror (write on the origin).
            IntegrityError: an existing object with this sha no longer verifies.
        """
        data = _content_bytes(content)
        if not data:
            raise InvalidContentError("refusing to add an empty prefix")
        if note is not None:
            check_text(note, "the note")
        check_text(source, "the source label")
        if source.startswith(PROBE_SOURCE_PREFIX):
            raise UsageError(f"the source label {source!r} is reserved for probe slices")
        if name is not None:
            validate_name(name)
        sha = sha256_hex(data)
        self.init()
        self.refuse_on_mirror("add a prefix")
        self._put_object(sha, data)
        self._write_meta(sha, len(data), note=note, source=source)
        if name is not None:
            self.move_name(name, sha)
        return sha

    def add_frame(
        self,
        system: str,
        *,
        tools: str | bytes | None = None,
        settings: dict[str, object] | None = None,
        name: str | None = None,
        note: str | None = None,
        force: bool = False,
    ) -> str:
        """Register a frame (the system prefix `system` names, the tools JSON as exact bytes,
        the prompt settings) and return its sha; see `registry.frames.write_frame`."""
        from prefixreg.registry.frames import write_frame

        return write_frame(
            self, system, tools=tools, settings=settings, name=name, note=note, force=force
        )

    def add_probe_slice(self, content: bytes | str, *, run_id: str) -> str:
        """Store a slice probe run `run_id` sends, as `add` stores a prefix (same object and
        meta checks), its meta marked as a probe slice (`probeslices`); return its sha.

        Raises: as `add` (a `run_id` that is not UTF-8 text is a `UsageError`).
        """
        data = _content_bytes(content)
        if not data:
            raise InvalidContentError("refusing to add an empty prefix")
        label = probe_source(check_text(run_id, "the probe run id"))
        sha = sha256_hex(data)
        self.init()
        self.refuse_on_mirror("register probe slices")
        self._put_object(sha, data)
        self._write_meta(sha, len(data), note=f"probe {run_id}", source=label)
        return sha

    def is_probe_slice(self, sha: str) -> bool:
        """Does the meta record of `sha` mark a probe slice? (No meta record: no.)

        Raises: CorruptRecordError: the meta record does not parse.
        """
        try:
            meta = self.meta(sha)
        except RefNotFoundError:
            return False
        return is_probe_source(meta.source, meta.note)

    def list_objects(self) -> list[ObjectInfo]:
        """Every object with its meta and names, oldest first (meta is parsed, bytes not read).

        Raises:
            IntegrityError: a symlinked registry directory, or an object that is not a
                regular file (never listed through).
        """
        by_sha: dict[str, list[str]] = {}
        for name, sha in self.names().items():
            by_sha.setdefault(sha, []).append(name)
        out = []
        for sha in self.iter_shas(regular_only=True):
            try:
                meta: Meta | None = self.meta(sha)
            except RefNotFoundError:
                meta = None
            out.append(
                ObjectInfo(
                    sha256=sha,
                    bytes=meta.bytes if meta else None,
                    created=meta.created if meta else None,
                    note=meta.note if meta else None,
                    names=tuple(sorted(by_sha.get(sha, ()))),
                    probe_slice=meta is not None and is_probe_source(meta.source, meta.note),
                )
            )
        out.sort(key=lambda o: (o.created or "", o.sha256))
        return out

    # -- measurements ---------------------------------------------------------------------

    def write_measurement(self, measurement: Measurement) -> Path:
        """Write one measurement record; never overwrites an existing one.

        Raises:
            UsageError: the registry is a mirror (measure against the origin).
            IntegrityError: `measurements/` is a symlink.
        """
        sha = measurement.sha256
        self.init()
        self.refuse_on_mirror("write a measurement")
        directory = self.writable_dir(layout.MEASUREMENTS)
        data = dumps_canonical(measurement.to_dict()) + b"\n"
        for _ in range(100):
            path = directory / layout.measurement_filename(sha, stamp_utc(utc_now()))
            if fsutil.publish_new(path, data, mode=0o444):
                return path
        raise PrefixregError(f"could not find a free measurement file name for {sha}")

    def measurements(self, sha: str | None = None) -> list[Measurement]:
        """Measurement records (of one prefix, or all), oldest first.

        Raises:
            CorruptRecordError: a record that does not parse (fail closed).
            IntegrityError: `measurements/` or a record is a symlink or not a regular file.
        """
        out = []
        for entry, _kind in self.entries(layout.MEASUREMENTS):
            if layout.is_temp_name(entry) or not entry.endswith(".json"):
                continue
            if sha is not None and layout.measurement_sha(entry) != sha:
                continue
            out.append(self.load_measurement(entry))
        out.sort(key=lambda m: m.at)
        return out

    def load_measurement(self, filename: str) -> Measurement:
        """One measurement record by its file name in `measurements/`, parsed strictly.

        Raises:
            CorruptRecordError: it does not parse, or its name disagrees with its sha.
        """
        from prefixreg.core.records import Measurement

        rel = f"{layout.MEASUREMENTS}/{filename}"
        path = self.root / rel
        try:
            record = Measurement.from_dict(loads_object(self.read_file(rel), path=path))
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{path}: {exc}", path=path) from None
        if layout.measurement_sha(filename) != record.sha256:
            raise CorruptRecordError(f"{path}: records sha {record.sha256}", path=path)
        return record

    # -- receipts and journals ------------------------------------------------------------

    def write_probe_receipt(
        self, stamp: str, render: Callable[[Path, Path], tuple[bytes, bytes]]
    ) -> tuple[Path, Path]:
        """Publish a probe's receipt (`probes/<ts>.json`) and verdict (`probes/<ts>.md`), never
        overwriting: a taken stamp is retried with a fresh one. `render(json_path, md_path)`
        gives (receipt bytes, verdict bytes) for the paths chosen, since a receipt names its
        own files. The verdict lands first, so the receipt appearing means both are there.
        Returns (json path, md path).

        Raises:
            IntegrityError: `probes/` is a symlink (nothing is written).
        """
        self.init()
        directory = self.writable_dir(layout.PROBES)
        for attempt in range(100):
            name = stamp if attempt == 0 else stamp_utc(utc_now())
            json_name, md_name = layout.probe_filenames(name)
            json_path, md_path = directory / json_name, directory / md_name
            receipt, verdict = render(json_path, md_path)
            if not fsutil.publish_new(md_path, verdict, mode=0o444):
                continue
            if fsutil.publish_new(json_path, receipt, mode=0o444):
                return json_path, md_path
            md_path.unlink()  # the receipt's name was taken: its verdict goes with it
        raise PrefixregError(f"could not find a free probe receipt name for {stamp}")

    def probe_receipts(self) -> list[tuple[Path, bytes]]:
        """Every probe receipt (`probes/<ts>.json`), newest first, as (path, raw bytes).
        Unreadable receipts are skipped (a receipt is history, not a budget).

        Raises:
            IntegrityError: `probes/` is a symlink (never listed through).
        """
        out = []
        for entry, kind in reversed(self.entries(layout.PROBES)):
            if kind != "file" or layout.is_temp_name(entry) or not entry.endswith(".json"):
                continue
            rel = f"{layout.PROBES}/{entry}"
            try:
                out.append((self.root / rel, self.read_file(rel)))
            except (OSError, PrefixregError):
                continue
        return out

    def append_mirror_log(self, line: bytes) -> None:
        """Append one JSON line to `mirror.log` (durably, never through a symlink)."""
        fsutil.append_line(self.root / layout.MIRROR_LOG, line, root=self.root)

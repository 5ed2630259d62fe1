"""`Registry`: one registry on disk, composed of parts; the face every verb and command uses.

Parts: `Disk` (root, marker, lock, no-follow access; package-private), `Objects`, `Frames`,
`Names` and `Records`; `snapshots`, verify, gc and migrate sit above. One resolver is behind
`head`, `frame`, `get`, `resolve` and `move_name`.

Invariants:
- Arguments, types included, and a name that would change kind without `force`, are
  checked before anything is written: a refused call writes nothing.
- Measurements and probe receipts are published with no-overwrite links (mode 0444), never
  through a symlinked directory; a taken name is retried with a fresh stamp, never replaced.
  `mirror.log` lines are appended whole or not at all (`fsutil.append_line`).
- Write order is object, meta, name: a crash leaves at worst an object without meta (verify
  warns; adding again repairs it) or a temp file, never a meta record or a name whose object
  is missing; a frame's are parts, record, name (a re-add refreshes the mtime gc ages by).
  A mirror (role `mirror`) is written only by `prefixreg mirror`.
- A reference is a name, a full sha or a unique abbreviation of 8+ hex digits (a name wins
  over an abbreviation spelt the same) of a prefix or a frame. A name whose target is
  missing is an `IntegrityError`, never an unknown reference.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prefixreg.core import errors
from prefixreg.core.digest import is_full_sha, looks_like_sha, parse_abbrev, sha256_hex
from prefixreg.core.frame import Frame, encode_frame_record, parse_lead, parse_tools
from prefixreg.core.jsonio import dumps_canonical
from prefixreg.core.prefix import Prefix
from prefixreg.registry import fsutil, layout, objects
from prefixreg.registry.disk import Disk
from prefixreg.registry.layout import iso_utc as iso_utc
from prefixreg.registry.layout import stamp_utc as stamp_utc
from prefixreg.registry.layout import utc_now as utc_now
from prefixreg.registry.layout import validate_name as validate_name
from prefixreg.registry.names import UNSET, Names, Records
from prefixreg.registry.names import NameConflictError as NameConflictError
from prefixreg.registry.userfiles import note_registry

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement, Meta, NameMove


class Registry:
    """The registry at `root`, created at the first write; `lock_timeout`: seconds to wait
    for the lock. Raises: UsageError (`root` not a path, `lock_timeout` not a finite number
    >= 0); RegistryLocationError (a file, a non-empty directory without `REGISTRY.json`, or
    a registry of a newer format)."""

    def __init__(self, root: Path | str, *, lock_timeout: float = 30.0) -> None:
        path: object = os.fspath(root) if isinstance(root, os.PathLike) else root
        errors.check_type(path, str, "Registry: root", "a path (str or Path)")  # the API door
        if not str(path) or "\0" in str(path):
            raise errors.ArgumentValueError(f"Registry: root is a path, not {root!r:.60}")
        wait: object = lock_timeout
        if type(wait) not in (int, float) or not math.isfinite(lock_timeout) or lock_timeout < 0:
            raise errors.UsageError(f"lock_timeout must be a finite number >= 0, not {wait!r}")
        self.root = Path(root)
        self.lock_timeout = float(lock_timeout)
        self._disk = Disk(self.root)
        self._objects = objects.Objects(self._disk)
        self._names = Names(self._disk, self.lock)
        self._records = Records(self._disk)
        self._frames = objects.Frames(self._disk, self._objects)
        note_registry(self.root)  # no output a user names may land in it (`check_output_file`)

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    @property
    def exists(self) -> bool:
        """True once the registry has been initialised (its marker exists)."""
        return self._disk.marker is not None or (self.root / layout.MARKER).exists()

    @property
    def role(self) -> str | None:
        """`origin` or `mirror`, or None before initialisation."""
        marker = self._disk.marker or (self._disk.load_marker() if self.root.is_dir() else None)
        return None if marker is None else str(marker["role"])

    def init(self, *, role: Literal["origin", "mirror"] = "origin") -> None:
        """Create the registry if it does not exist yet (idempotent, safe to race)."""
        if role not in ("origin", "mirror"):
            raise errors.UsageError(f"a registry role is origin or mirror, not {role!r}")
        self._disk.create(role)

    def refuse_on_mirror(self, what: str) -> None:
        """Refuse a write on a mirror (`UsageError`): the next mirror run would delete it."""
        if self.role == "mirror":
            why = f"{self.root} is a mirror; refusing to {what} here"
            hint = "write on the origin registry (the coordinator), then run prefixreg mirror"
            raise errors.UsageError(f"{why} (the next mirror run would delete it)", hint=hint)

    @contextlib.contextmanager
    def lock(self, name: str = "registry") -> Iterator[None]:
        """Hold `.locks/<name>.lock` (`registry`: gc and name moves). Raises: LockTimeoutError;
        IntegrityError (a symlinked `.locks/` or lock file)."""
        layout.validate_name(name)
        self.init()
        with self._disk.lock(name, self.lock_timeout):
            yield

    def _find(self, ref: str) -> tuple[str, str | None]:
        """(sha, the name it was reached by) of a prefix or a frame."""
        given: object = ref  # the API boundary: callers may pass anything
        if not isinstance(given, str):
            raise errors.UsageError(f"a reference is a string, not {type(given).__name__}")
        if is_full_sha(ref):
            return ref, None
        if layout.NAME_RE.fullmatch(ref) is not None and not is_full_sha(ref.lower()):
            sha = self._names.read(ref)
            if sha is not None:
                return sha, ref
        if not looks_like_sha(ref) or len(ref) < 8:
            if layout.NAME_RE.fullmatch(ref) is None:
                why = f"invalid reference {ref!r}: not a name, a sha256, or 8+ hex digits of one"
                raise errors.InvalidDigestError(why)
            hint = "an abbreviated sha needs at least 8 hex digits" if looks_like_sha(ref) else None
            why = f"no prefix or frame named {ref!r}{self._names.did_you_mean(ref)}"
            raise errors.RefNotFoundError(why, hint=hint)
        abbrev = parse_abbrev(ref)
        if len(abbrev) == 64:
            return abbrev, None
        prefixes = set(self._objects.shas(regular_only=True, prefix=abbrev))
        found = sorted(prefixes.union(s for s in self._frames.shas() if s.startswith(abbrev)))
        if not found:
            raise errors.RefNotFoundError(f"no prefix or frame matches {ref!r}")
        if len(found) > 1:
            why = f"{ref!r} matches {len(found)} heads: {', '.join(m[:12] for m in found[:5])}"
            raise errors.AmbiguousRefError(why, candidates=found)
        return found[0], None

    def _read(self, sha: str, name: str | None, ref: object = None) -> bytes:
        """The verified bytes of object `sha`, reached by `name`."""
        try:
            return self._objects.read(sha)
        except errors.RefNotFoundError:
            if self._names.is_frame(sha):
                why = f"{ref or sha!r} names frame {sha[:12]}, not a prefix"
                raise errors.RefNotFoundError(why, hint="a frame is a head: use head()") from None
            if name is None:
                raise
            path = self._disk.path(layout.name_relpath(name))
            message = f"name {name!r} points to {sha}, which is missing"
            raise errors.IntegrityError(message, path=path) from None

    def _head(self, sha: str, name: str | None = None) -> Prefix | Frame:
        if self._names.is_frame(sha):
            return self._frames.read(sha, name=name)
        return Prefix(sha, self._read(sha, name), name)

    def head(self, ref: str) -> Prefix | Frame:
        """The verified prefix or frame `ref` names: what every verb sends. Raises: UsageError
        (not a string); RefNotFoundError, AmbiguousRefError, InvalidDigestError;
        IntegrityError (fails verification, or a name's target is missing)."""
        return self._head(*self._find(ref))

    def frame(self, ref: str) -> Frame:
        """The verified frame `ref` names (a prefix: `RefNotFoundError`). Raises as `head`."""
        head = self.head(ref)
        if not isinstance(head, Frame):
            raise errors.RefNotFoundError(f"no frame {ref!r} ({head.sha256[:12]} is a prefix)")
        return head

    def get(self, ref: str) -> Prefix:
        """The verified prefix `ref` names (a frame: `RefNotFoundError`). Raises as `head`."""
        # A full sha needs no lookup: the verified read itself says whether it exists.
        sha, name = (ref, None) if type(ref) is str and is_full_sha(ref) else self._find(ref)
        return Prefix(sha, self._read(sha, name, ref), name)

    def resolve(self, ref: str) -> str:
        """The full sha of the prefix or frame `ref` names (not verified). Raises as `head`."""
        sha, name = self._find(ref)
        if self._disk.lstat(layout.object_relpath(sha)) is None and not self._names.is_frame(sha):
            self._read(sha, name)  # raises: unknown, or missing behind a name
        return sha

    def read_verified(self, sha: str) -> bytes:
        """Object `sha`'s bytes, re-hashed. Raises: UsageError, RefNotFoundError, IntegrityError."""
        return self._objects.read(layout.need_sha(sha))

    def add(
        self,
        content: bytes | str,
        *,
        name: str | None = None,
        note: str | None = None,
        source: str = "api",
        force: bool = False,
    ) -> str:
        """Store `content` (exact bytes, valid UTF-8) under its sha256, idempotent; point `name`
        at it (a name holding a frame moves only with `force`); `source`: where it came from (a
        file name, "stdin"). A probe slice becomes the user's. Raises: InvalidContentError
        (empty, not bytes or str, not UTF-8); InvalidNameError; NameConflictError (`name`
        holds a frame: nothing written); UsageError (a note or source not UTF-8 text, or a
        mirror); IntegrityError (an existing object no longer verifies)."""
        data = objects.content_bytes(content)
        if note is not None:
            objects.check_text(note, "the note")
        if objects.check_text(source, "the source label").startswith(objects.PROBE_SOURCE_PREFIX):
            raise errors.UsageError(f"the source label {source!r} is reserved for probe slices")
        if name is not None:
            layout.validate_name(name)
            self._names.precheck(name, to_frame=False, force=force is True)
        sha = self._store(data, note=note, source=source, what="add a prefix")
        if name is not None:
            self.move_name(name, sha, force=force)
        return sha

    def add_frame(
        self,
        system: str,
        *,
        tools: str | bytes | None = None,
        settings: Mapping[str, object] | None = None,
        name: str | None = None,
        note: str | None = None,
        force: bool = False,
        messages: str | bytes | None = None,
    ) -> str:
        """Register a frame, idempotent; its sha. `system` names the system prefix, `tools` is
        a JSON list of tool objects (kept as its bytes), `settings` `core.frame.PROMPT_SETTINGS`,
        `messages` a JSON list of the leading messages sent after the system one (its bytes);
        a `name` holding a prefix moves only with `force`. Raises: UsageError (bad tools JSON,
        setting, name or argument, or a mirror); NameConflictError (`name` holds a prefix:
        nothing written); IntegrityError (a part or existing record)."""
        if name is not None:
            layout.validate_name(name)
        given: tuple[object, object] = (tools, settings)  # the API boundary: anything may come
        errors.check_type(given[0], (str, bytes, type(None)), "add_frame: tools", "JSON text")
        errors.check_type(messages, (str, bytes, type(None)), "add_frame: messages", "JSON text")
        errors.check_type(given[1], (Mapping, type(None)), "add_frame: settings", "a mapping")
        if any(not isinstance(key, str) for key in settings or {}):
            raise errors.ArgumentTypeError("add_frame: settings' keys are setting names (str)")
        self.init()
        self.refuse_on_mirror("register a frame")
        system_prefix = self.get(system)  # verified
        if note is not None:
            objects.check_text(note, "the note")
        data = None
        if tools is not None:
            data = tools.encode("utf-8") if isinstance(tools, str) else tools
            parse_tools(data)
            data = objects.content_bytes(data)
        tools_sha = None if data is None else sha256_hex(data)
        lead = None if messages is None else objects.content_bytes(messages)
        if lead is not None:
            parse_lead(lead)
        lead_sha = None if lead is None else sha256_hex(lead)
        record = encode_frame_record(
            system_prefix.sha256, tools_sha, settings or {}, messages=lead_sha
        )
        if name is not None:  # a refused name writes nothing: neither the tools nor the record
            self._names.precheck(name, to_frame=True, force=force is True)
        # Parts re-added (mtime refreshed), then the record: a racing gc sees them used.
        self._objects.put(system_prefix.sha256, system_prefix.data)
        for part, source in ((data, "tools"), (lead, "messages")):
            if part is not None:
                self._store(part, note=note, source=source, what="register a frame")
        sha = self._frames.publish(record)
        if name is not None:
            self.move_name(name, sha, force=force)
        return sha

    def add_probe_slice(self, content: bytes | str, *, run_id: str) -> str:
        """Store a slice probe run `run_id` sends, marked as a probe slice. Raises as `add`."""
        label = objects.PROBE_SOURCE_PREFIX + objects.check_text(run_id, "the probe run id")
        data = objects.content_bytes(content)
        return self._store(data, note=f"probe {run_id}", source=label, what="add probe slices")

    def _store(self, data: bytes, *, note: str | None, source: str, what: str) -> str:
        sha = sha256_hex(data)
        self.init()
        self.refuse_on_mirror(what)
        self._objects.put(sha, data)
        self._objects.write_meta(sha, len(data), note=note, source=source)
        return sha

    def move_name(
        self, name: str, ref: str, *, expect: object = UNSET, force: bool = False
    ) -> NameMove | None:
        """Point `name` at the head `ref` names (verified, again under the lock), journal first;
        None if already so. `expect`: the sha (None: unset) it must hold; `force`: move it from
        a prefix to a frame or back. Raises: InvalidNameError (8-64 hex digits too);
        NameConflictError (`expect` does not hold, or a kind change without `force`);
        UsageError (a bad reference or argument, a mirror); IntegrityError (the target fails
        verification, or a symlinked `names.log`, `names/` or `.locks/`); PrefixregError
        (the journal could not be written: not moved)."""
        layout.validate_name(name)
        if expect is not UNSET and expect is not None:
            layout.need_sha(expect)
        self.refuse_on_mirror("move a name")
        sha, found_by = self._find(ref)
        self._head(sha, found_by)  # never point a name at something that fails verification
        return self._names.move(name, sha, self._head, expect=expect, force=force is True)

    def object_path(self, sha: str) -> Path:
        """Where the object `sha` lives (whether or not it exists)."""
        return self._disk.path(layout.object_relpath(sha))

    def meta(self, sha: str) -> Meta:
        """The meta record of `sha`. Raises: RefNotFoundError (none), CorruptRecordError."""
        return self._objects.meta(layout.need_sha(sha))

    def legacy_records(self, sha: str) -> list[tuple[str, bytes]]:
        """An adopted object's own history records, byte-identical (see `Objects`)."""
        return self._objects.legacy_records(layout.need_sha(sha))

    def iter_shas(self) -> Iterator[str]:
        """Every object sha present (by file name; not verified), sorted."""
        return self._objects.shas()

    def is_probe_slice(self, sha: str) -> bool:
        """Does the meta record of `sha` mark a probe slice? (No meta record: no.)"""
        try:
            meta = self.meta(sha)
        except errors.RefNotFoundError:
            return False
        return objects.is_probe_source(meta.source, meta.note)

    def list_objects(self, *, frames: bool = False) -> list[objects.ObjectInfo]:
        """Every object (with `frames`, every frame) with its meta and names, oldest first;
        bytes are not read; a frame's tools are kind `tools`, its leading messages kind
        `messages`, the note naming the frames.
        Raises: IntegrityError (a symlink, an object not a file)."""
        by_sha: dict[str, list[str]] = {}
        for name, sha in self.names().items():
            by_sha.setdefault(sha, []).append(name)
        return objects.list_rows(self._objects, self._frames, by_sha, frames=frames)

    def names(self) -> dict[str, str]:
        """Every name and the sha it points to, sorted by name. Raises: IntegrityError."""
        return self._names.all()

    def read_name(self, name: str) -> str | None:
        """The sha `names/<name>` holds, or None. Raises: InvalidNameError, IntegrityError."""
        return self._names.read(name)

    def name_log(self) -> list[NameMove]:
        """Every committed name move, oldest first. Raises: CorruptRecordError."""
        return self._names.log()

    def measurements(self, sha: str | None = None) -> list[Measurement]:
        """Measurement records (of one prefix, or all), oldest first. Raises: IntegrityError."""
        return self._records.measurements(sha)

    def write_measurement(self, measurement: Measurement) -> Path:
        """Write one measurement record, never overwriting. Raises: UsageError, IntegrityError."""
        from prefixreg.core.records import Measurement

        self.init()
        self.refuse_on_mirror("write a measurement")
        if not isinstance(measurement, Measurement):
            raise errors.UsageError(f"not a Measurement: {type(measurement).__name__}")
        directory = self._disk.mkdir(layout.MEASUREMENTS)
        data = dumps_canonical(measurement.to_dict()) + b"\n"
        for _ in range(100):
            stamp = layout.stamp_utc(layout.utc_now())
            path = directory / layout.measurement_filename(measurement.sha256, stamp)
            if fsutil.publish_new(path, data, mode=0o444):
                return path
        raise errors.PrefixregError(f"no free measurement file name for {measurement.sha256}")

    def write_probe_receipt(
        self, stamp: str, render: Callable[[Path, Path], tuple[bytes, bytes]]
    ) -> tuple[Path, Path]:
        """Publish a probe's receipt (`probes/<ts>.json`) and verdict (`<ts>.md`), as
        `render(json_path, md_path)` gives them, verdict first; a taken stamp is retried.
        Raises: UsageError (not a UTC stamp), IntegrityError."""
        self.init()
        directory = self._disk.mkdir(layout.PROBES)
        for attempt in range(100):
            name = stamp if attempt == 0 else layout.stamp_utc(layout.utc_now())
            json_path, md_path = (directory / n for n in layout.probe_filenames(name))
            receipt, verdict = render(json_path, md_path)
            if not fsutil.publish_new(md_path, verdict, mode=0o444):
                continue
            if fsutil.publish_new(json_path, receipt, mode=0o444):
                return json_path, md_path
            md_path.unlink()  # the receipt's name was taken: its verdict goes with it
        raise errors.PrefixregError(f"no free probe receipt name for {stamp}")

    def probe_receipts(self) -> list[tuple[Path, bytes]]:
        """Every readable probe receipt, newest first, as (path, raw bytes)."""
        return [(path, raw) for path, raw in self._records.receipts() if raw is not None]

    def append_mirror_log(self, line: bytes) -> None:
        """Append one JSON line to `mirror.log`, whole or not at all, never through a link."""
        fsutil.append_line(self._disk.path(layout.MIRROR_LOG), line, root=self._disk.root)

"""`SnapshotRecord`: which head a saved KV-cache file holds, on which server build. Pure.

A record, `snapshots/<sha256>-<build_id>.json` (DESIGN §3), ties a head's sha to the build
its state was saved on and the file the server wrote (`--slot-save-path DIR/<file>`), with
its sha256, blake3 and size: a restore refuses a changed file before any request is sent.

Invariants (checked on every construction, so on every load; `CorruptRecordError` else):
- Every field has its exact JSON type; the build's `build_id` is re-derived from its identity.
- `file` is derived, never chosen: `prefixreg-<head sha>-<build_id>.bin`; a record naming
  any other file (`passwd`) is refused, so the server never reads a file a record names.
- The file's sha256, blake3 and size are required (a record that cannot be checked is no
  record), and so is `slot_dir`, absolute: where the file was hashed.
- A record is never evidence that a restore works: only the resume check after one is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any, Final

from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.fields import obj, strict_count, strict_number
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import ServerBuild

SNAPSHOT_KIND: Final = "kv-snapshot"
_FILE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_WHAT: Final = "snapshot record"
_REQUIRED: Final = ("file_bytes", "n_saved", "slot_id")


def validate_file_name(name: object) -> str:
    """A bare snapshot file name (no directory, no leading dot), or a `UsageError`."""
    if not isinstance(name, str) or _FILE_RE.fullmatch(name) is None:
        raise UsageError(f"not a bare snapshot file name: {name!r}")
    return name


def snapshot_file_name(sha256: str, build_id: str) -> str:
    """`prefixreg-<sha>-<build>.bin`: a head's snapshot file on one build (a save replaces it)."""
    if not (_hex(sha256, 64) and _hex(build_id, 16)):
        raise UsageError(f"cannot name a snapshot for {sha256!r} on build {build_id!r}")
    return f"prefixreg-{sha256}-{build_id}.bin"


def _hex(value: object, digits: int) -> bool:
    """`value` is a string of exactly `digits` lowercase hex digits (a sha256: 64)."""
    return isinstance(value, str) and re.fullmatch(f"[0-9a-f]{{{digits}}}", value) is not None


# The on-disk form: top-level fields, and the nested groups' keys -> field names.
_TOP: Final = ("sha256", "n_saved", "save_ms", "created", "worker")
_NESTED: Final = {
    "file": {
        "name": "file",
        "sha256": "file_sha256",
        "blake3": "file_blake3",
        "bytes": "file_bytes",
        "n_written": "n_written",
        "slot_dir": "slot_dir",
    },
    "slot": {"id": "slot_id", "n_ctx": "slot_ctx"},
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """A saved KV snapshot of a head on one build: sha256 names the file between hosts, blake3
    (as strong, faster) is what a restore re-checks; `n_written` is the server's byte count."""

    sha256: str
    build: ServerBuild
    file: str
    file_sha256: str
    file_blake3: str
    file_bytes: int
    slot_dir: str
    n_saved: int
    n_written: int | None
    save_ms: float | None
    slot_id: int
    slot_ctx: int | None
    created: str
    worker: str | None = None

    def __post_init__(self) -> None:
        def bad(why: str) -> CorruptRecordError:
            return CorruptRecordError(f"{_WHAT}: {why}")

        if not _hex(self.sha256, 64) or not isinstance(self.build, ServerBuild):
            raise bad("'sha256' is not a sha256, or 'build' not a server build")
        if not (_hex(self.file_sha256, 64) and _hex(self.file_blake3, 64)):
            raise bad("the file's sha256 and blake3 must be 64 lowercase hex digits")
        expected = snapshot_file_name(self.sha256, self.build.build_id)
        if self.file != expected:
            raise bad(f"file {self.file!r} is not {expected!r}, the name of its head and build")
        slot_dir: object = self.slot_dir  # callers outside the type checker pass anything
        if not (isinstance(slot_dir, str) and PurePath(slot_dir).is_absolute()):
            raise bad(f"'slot_dir' {self.slot_dir!r} is not an absolute directory")
        for key in ("file_bytes", "n_saved", "slot_id", "n_written", "slot_ctx"):
            value = getattr(self, key)
            if strict_count(value) is None and (value is not None or key in _REQUIRED):
                raise bad(f"{key!r} must be a non-negative integer")
        if self.save_ms is not None and strict_number(self.save_ms) is None:
            raise bad("'save_ms' must be a non-negative number")
        text: tuple[object, object] = (self.created, self.worker)
        if not isinstance(text[0], str) or not isinstance(text[1], str | None):
            raise bad("'created' must be a string, 'worker' a string or null")

    @property
    def build_id(self) -> str:
        return self.build.build_id

    @classmethod
    def from_dict(cls, data: object) -> SnapshotRecord:
        d = obj(data, _WHAT)
        if d.get("kind") != SNAPSHOT_KIND:
            raise CorruptRecordError(f"{_WHAT}: field 'kind' must be {SNAPSHOT_KIND!r}")
        flat: dict[str, Any] = {key: d.get(key) for key in _TOP}
        for group, keys in _NESTED.items():
            part = obj(d.get(group), f"{_WHAT} {group}")
            flat |= {name: part.get(key) for key, name in keys.items()}
        return cls(build=ServerBuild.from_dict(d.get("build")), **flat)

    def to_dict(self) -> JSONObject:
        out: JSONObject = {"kind": SNAPSHOT_KIND, "build": self.build.to_dict()}
        out |= {key: getattr(self, key) for key in _TOP}
        for group, keys in _NESTED.items():
            out[group] = {key: getattr(self, name) for key, name in keys.items()}
        return out

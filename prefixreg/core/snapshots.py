"""`SnapshotRecord`: which prefix a saved KV-cache file holds, on which server build. Pure.

A record lives at `snapshots/<sha256>-<build_id>.json` (DESIGN §3): one per prefix and
server build. It ties the exact prefix bytes (their sha) to the build the state was saved
on and to the file the server wrote (`--slot-save-path DIR/<file>`), with the file's own
sha256 and size when that directory was readable from here, so a restore can refuse a file
that changed on disk before any request is sent.

Invariants:
- `from_dict` validates every field's JSON type exactly and raises `CorruptRecordError` on
  anything unexpected; the build's `build_id` is re-derived from its identity on load.
- `file` is a bare file name (`[A-Za-z0-9][A-Za-z0-9._-]*`): the server joins it to its
  own directory, so it must never carry a path.
- A record is never evidence that a restore works: only the resume check after a restore is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import ServerBuild, strict_count

__all__ = ["SNAPSHOT_KIND", "SnapshotRecord", "snapshot_file_name", "validate_file_name"]

SNAPSHOT_KIND: Final = "kv-snapshot"
_FILE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_WHAT: Final = "snapshot record"


def validate_file_name(name: object) -> str:
    """A bare snapshot file name (no directory, no leading dot), or a `UsageError`."""
    if not isinstance(name, str) or _FILE_RE.fullmatch(name) is None:
        raise UsageError(f"not a bare snapshot file name: {name!r}")
    return name


def snapshot_file_name(sha256: str, build_id: str) -> str:
    """The server-side file name of a prefix's snapshot on one build: `prefixreg-<sha>-<build>.bin`.

    Derived, not chosen: saving the same prefix on the same build again replaces the file.
    """
    if not is_full_sha(sha256) or re.fullmatch(r"[0-9a-f]{16}", build_id) is None:
        raise UsageError(f"cannot name a snapshot for {sha256!r} on build {build_id!r}")
    return f"prefixreg-{sha256}-{build_id}.bin"


def _str(d: Mapping[str, object], key: str, *, optional: bool = False) -> str | None:
    value = d.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise CorruptRecordError(f"{_WHAT}: field {key!r} must be a string")
    return value


def _count(d: Mapping[str, object], key: str, *, optional: bool = False) -> int | None:
    value = d.get(key)
    if value is None and optional:
        return None
    count = strict_count(value)
    if count is None:
        raise CorruptRecordError(f"{_WHAT}: field {key!r} must be a non-negative integer")
    return count


def _ms(d: Mapping[str, object], key: str) -> float | None:
    value = d.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or cast(float, value) < 0:
        raise CorruptRecordError(f"{_WHAT}: field {key!r} must be a non-negative number")
    return float(cast(float, value))


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotRecord:
    """One saved KV snapshot of a registered prefix on one server build.

    `file_sha256`/`file_blake3`/`file_bytes` are None when the server's snapshot directory
    was not readable from where the save ran (sha256 names the file for copies between
    hosts; blake3, as strong and several times faster, is what a restore re-checks).
    `n_written` is the server's own byte count.
    `slot_dir` is that directory as the saver saw it (a local path or None): where a later
    restore on this host re-hashes the file.
    """

    sha256: str
    build: ServerBuild
    file: str
    n_saved: int
    n_written: int | None
    save_ms: float | None
    slot_id: int
    slot_ctx: int | None
    created: str
    file_sha256: str | None = None
    file_blake3: str | None = None
    file_bytes: int | None = None
    slot_dir: str | None = None
    worker: str | None = None

    def __post_init__(self) -> None:
        if not is_full_sha(self.sha256):
            raise CorruptRecordError(f"{_WHAT}: 'sha256' is not a sha256")
        for key in ("file_sha256", "file_blake3"):
            value = getattr(self, key)
            if value is not None and not is_full_sha(value):  # both are 64 lowercase hex
                raise CorruptRecordError(f"{_WHAT}: {key!r} is not 64 lowercase hex digits")
        try:
            validate_file_name(self.file)
        except UsageError as exc:
            raise CorruptRecordError(f"{_WHAT}: {exc}") from None

    @property
    def build_id(self) -> str:
        return self.build.build_id

    @classmethod
    def from_dict(cls, data: object) -> SnapshotRecord:
        if not isinstance(data, dict):
            raise CorruptRecordError(f"{_WHAT}: expected a JSON object")
        d = cast(JSONObject, data)
        if d.get("kind") != SNAPSHOT_KIND:
            raise CorruptRecordError(f"{_WHAT}: field 'kind' must be {SNAPSHOT_KIND!r}")
        file = d.get("file")
        if not isinstance(file, dict):
            raise CorruptRecordError(f"{_WHAT}: field 'file' must be an object")
        slot = d.get("slot")
        if not isinstance(slot, dict):
            raise CorruptRecordError(f"{_WHAT}: field 'slot' must be an object")
        return cls(
            sha256=cast(str, _str(d, "sha256")),
            build=ServerBuild.from_dict(d.get("build")),
            file=cast(str, _str(file, "name")),
            file_sha256=_str(file, "sha256", optional=True),
            file_blake3=_str(file, "blake3", optional=True),
            file_bytes=_count(file, "bytes", optional=True),
            n_written=_count(file, "n_written", optional=True),
            slot_dir=_str(file, "slot_dir", optional=True),
            n_saved=cast(int, _count(d, "n_saved")),
            save_ms=_ms(d, "save_ms"),
            slot_id=cast(int, _count(slot, "id")),
            slot_ctx=_count(slot, "n_ctx", optional=True),
            created=cast(str, _str(d, "created")),
            worker=_str(d, "worker", optional=True),
        )

    def to_dict(self) -> JSONObject:
        return {
            "kind": SNAPSHOT_KIND,
            "sha256": self.sha256,
            "build": self.build.to_dict(),
            "file": {
                "name": self.file,
                "sha256": self.file_sha256,
                "blake3": self.file_blake3,
                "bytes": self.file_bytes,
                "n_written": self.n_written,
                "slot_dir": self.slot_dir,
            },
            "n_saved": self.n_saved,
            "save_ms": self.save_ms,
            "slot": {"id": self.slot_id, "n_ctx": self.slot_ctx},
            "created": self.created,
            "worker": self.worker,
        }

"""On-disk format v1 as pure rules: every path under a registry root, every parse of one, and
the two spellings of a moment records use (DESIGN §3). The one place the layout is written.

Invariants:
- No I/O: paths are POSIX strings relative to the root, one rule for the store, verify, gc,
  migrate and the mirror's rsync plans alike.
- Every builder validates its input before a path is made (a sha is 64 lowercase hex, a name
  matches NAME_RE; a wrong type is a `UsageError`), so no id or name can escape its
  directory. Every parser is the exact inverse of its builder and returns None otherwise.
- Records take their time from `utc_now`; `iso_utc` and `stamp_utc` round once to whole
  microseconds (never wrapping the fraction without carrying the seconds).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Final

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import InvalidNameError, UsageError

FORMAT: Final = "prefix-registry"
FORMAT_VERSION: Final = 1
MARKER: Final = "REGISTRY.json"
README: Final = "README.md"
NAMES_LOG: Final = "names.log"
MIRROR_LOG: Final = "mirror.log"
MIGRATIONS_LOG: Final = "migrations.log"
LEGACY: Final = "legacy.json"  # an adopted hand-built registry's history records and extras
OBJECTS: Final = "objects"
META: Final = "meta"
NAMES: Final = "names"
MEASUREMENTS: Final = "measurements"
PROBES: Final = "probes"
SNAPSHOTS: Final = "snapshots"
FRAMES: Final = "frames"
LOCKS: Final = ".locks"
# What `verify` expects at the root, temp files aside; the store creates each on first write.
EXPECTED_DIRS: Final = (OBJECTS, META, NAMES, MEASUREMENTS, PROBES, SNAPSHOTS, FRAMES, LOCKS)
ROOT_FILES: Final = frozenset({MARKER, README, NAMES_LOG, MIRROR_LOG, MIGRATIONS_LOG, LEGACY})
FORMAT_DOC: Final = "the README's 'On-disk format' section"  # what errors about the layout cite
# Append-only journals: a line is committed once its newline is durable.
JOURNALS: Final = frozenset({NAMES_LOG, MIRROR_LOG, MIGRATIONS_LOG})
TMP_SUFFIX: Final = ".tmp"  # durable writers' temp files: `.<target>.<random>.tmp`

NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SNAPSHOT_RECORD: Final = re.compile(r"([0-9a-f]{64})-[0-9a-f]{16}\.json")
# An entry of a fan-out `objects/<aa>/` (group 1: `<aa>`, which must be its directory's name)
# and of `meta/`: the names `object_sha` and `meta_sha` accept, matched once each.
OBJECT_FILE: Final = re.compile(r"(([0-9a-f]{2})[0-9a-f]{62})\.txt")
META_FILE: Final = re.compile(r"([0-9a-f]{64})\.json")
_SHA_LIKE: Final = re.compile(r"[0-9A-Fa-f]{8,64}")
_STAMP: Final = re.compile(r"\d{8}T\d{6}\.\d{6}Z")
_BUILD_ID: Final = re.compile(r"[0-9a-f]{16}")


def is_temp_name(name: str) -> bool:
    """True for a durable writer's temp file name (`.<target>.<random>.tmp`)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def need_sha(sha: object) -> str:
    """`sha` if it is a full sha256 (64 lowercase hex), else `UsageError`."""
    if not isinstance(sha, str) or not is_full_sha(sha):
        raise UsageError(f"not a sha256: {sha!r}")
    return sha


def utc_now() -> float:
    """The current time as a Unix timestamp (one place, so records agree on the clock)."""
    return time.time()


def _utc(moment: float, fmt: str) -> str:
    seconds, micros = divmod(round(moment * 1_000_000), 1_000_000)
    return time.strftime(fmt, time.gmtime(seconds)) + f".{micros:06d}Z"


def iso_utc(moment: float) -> str:
    """ISO 8601 UTC with microseconds: `2026-11-29T12:48:17.123456Z`."""
    return _utc(moment, "%Y-%m-%dT%H:%M:%S")


def stamp_utc(moment: float) -> str:
    """The file-name timestamp: UTC `%Y%m%dT%H%M%S.%fZ`."""
    return _utc(moment, "%Y%m%dT%H%M%S")


def encode_marker(role: str, created: str) -> bytes:
    """The bytes of `REGISTRY.json` for a new root of `role` (checked by the caller)."""
    from prefixreg.core.jsonio import dumps_canonical

    marker = {"format": FORMAT, "version": FORMAT_VERSION, "role": role, "created": created}
    return dumps_canonical(marker) + b"\n"


def marker_problem(data: Mapping[str, object]) -> tuple[str, str] | None:
    """What is wrong with a parsed `REGISTRY.json` as (kind, message), or None. kind: `foreign`
    (not our marker), `newer` (a format this code does not know), `corrupt` (a bad field)."""
    version = data.get("version")
    if data.get("format") != FORMAT:
        return "foreign", "not a prefix registry marker"
    if type(version) is not int:
        return "corrupt", "'version' must be an integer"
    if version > FORMAT_VERSION:
        newer = f"registry format {version} is newer than this prefixreg's ({FORMAT_VERSION})"
        return "newer", newer
    if data.get("role") not in ("origin", "mirror"):
        return "corrupt", "'role' must be origin or mirror"
    return None


def parse_legacy(data: Mapping[str, object]) -> tuple[dict[str, str], frozenset[str]] | None:
    """(record path -> sha256 of its bytes, root entries kept as the user's) of a parsed
    `legacy.json`, or None when a field is not of its shape."""
    records, kept = data.get("records"), data.get("kept")
    if data.get("format") != f"{FORMAT}-legacy" or not isinstance(records, dict):
        return None
    if not isinstance(kept, list) or not all(
        isinstance(k, str) and "/" not in k and k not in ("", ".", "..") for k in kept
    ):
        return None
    if not all(isinstance(s, str) and is_full_sha(s) for s in records.values()):
        return None
    return dict(records), frozenset(kept)


def object_relpath(sha: str) -> str:
    """`objects/<aa>/<sha>.txt`, where <aa> is the sha's first two hex digits."""
    return object_relpath_trusted(need_sha(sha))


def object_relpath_trusted(sha: str) -> str:
    """`object_relpath` of a sha its caller has checked, not checked again: a verified read
    (`Objects.read`, every `get`) pays for one check of its sha, not two."""
    return f"{OBJECTS}/{sha[:2]}/{sha}.txt"


def object_sha(relpath: str) -> str | None:
    """The sha that `objects/<aa>/<sha>.txt` stands for, or None for any other path."""
    parts = relpath.split("/")
    sha = parts[-1].removesuffix(".txt")
    shaped = len(parts) == 3 and parts[0] == OBJECTS and parts[2].endswith(".txt")
    return sha if shaped and is_full_sha(sha) and sha[:2] == parts[1] else None


def meta_relpath(sha: str) -> str:
    """`meta/<sha>.json`."""
    return f"{META}/{need_sha(sha)}.json"


def frame_relpath(sha: str) -> str:
    """`frames/<sha>.json`: a frame record (`prefixreg.core.frame`), named by its own sha."""
    return f"{FRAMES}/{need_sha(sha)}.json"


def _record_sha(relpath: str, directory: str) -> str | None:
    parts = relpath.split("/")
    sha = parts[-1].removesuffix(".json")
    shaped = len(parts) == 2 and parts[0] == directory and parts[1].endswith(".json")
    return sha if shaped and is_full_sha(sha) else None


def meta_sha(relpath: str) -> str | None:
    """The sha of `meta/<sha>.json`, or None for any other path."""
    return _record_sha(relpath, META)


def frame_sha(relpath: str) -> str | None:
    """The sha of `frames/<sha>.json`, or None for any other path."""
    return _record_sha(relpath, FRAMES)


def validate_name(name: object) -> str:
    """`name` if a new move may use it, else `InvalidNameError`: not a str, bad characters, a
    leading dot or dash, too long, or 8-64 hex digits (it would read as a sha reference)."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        why = f"invalid name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit"
        raise InvalidNameError(why)
    if is_sha_like_name(name):
        raise InvalidNameError(f"invalid name {name!r}: 8-64 hex digits read as a sha reference")
    return name


def is_sha_like_name(name: str) -> bool:
    """True for a name read as a sha reference (older names: still resolved, verify warns)."""
    return _SHA_LIKE.fullmatch(name) is not None


def name_relpath(name: object) -> str:
    """`names/<name>`, for any name the name rule accepts (old sha-like names included)."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(f"invalid name {name!r}")
    return f"{NAMES}/{name}"


def encode_name_file(sha: str) -> bytes:
    """The contents of a name file: 64 lowercase hex digits and a newline."""
    return need_sha(sha).encode("ascii") + b"\n"


def parse_name_file(raw: bytes) -> str | None:
    """The sha a name file holds, or None when it is not exactly `<64 hex>\\n`."""
    text = raw[:64].decode("ascii", errors="replace")
    return text if len(raw) == 65 and raw.endswith(b"\n") and is_full_sha(text) else None


def measurement_filename(sha: str, stamp: str) -> str:
    """`<sha>-<ts>.json` inside `measurements/`."""
    return f"{need_sha(sha)}-{stamp}.json"


def measurement_sha(filename: str) -> str | None:
    """The prefix sha a measurement file name starts with, or None if it is not one."""
    shaped = filename.endswith(".json") and len(filename) >= 66 and filename[64] == "-"
    return filename[:64] if shaped and is_full_sha(filename[:64]) else None


def probe_filenames(stamp: str) -> tuple[str, str]:
    """The receipt and the verdict of one probe: `<ts>.json` and `<ts>.md` in `probes/`."""
    given: object = stamp
    if not isinstance(given, str) or _STAMP.fullmatch(given) is None:
        raise UsageError(f"not a UTC stamp: {stamp!r}")
    return f"{stamp}.json", f"{stamp}.md"


def snapshot_filename(sha: str, build_id: str) -> str:
    """`<sha>-<build>.json` inside `snapshots/`: one KV snapshot record per prefix and build."""
    given: object = build_id
    if not isinstance(given, str) or _BUILD_ID.fullmatch(given) is None:
        raise UsageError(f"not a build id: {build_id!r}")
    return f"{need_sha(sha)}-{build_id}.json"

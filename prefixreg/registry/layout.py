"""On-disk format v1, as pure rules: every path under a registry root and every parse of a
path or a small layout file. The one place the layout is written down (DESIGN §3).

Invariants:
- Pure: no I/O, no `Path` resolution; paths are POSIX strings relative to the root, so the
  same rule serves the store, verify, gc, migrate and the mirror's rsync plans alike.
- Every builder validates its input before a path is made (a sha is 64 lowercase hex, a name
  matches NAME_RE), so no id or name can escape its directory; every parser is the exact
  inverse of its builder and returns None for anything that is not one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import InvalidNameError, UsageError

__all__ = [
    "EXPECTED_DIRS",
    "FORMAT",
    "FORMAT_VERSION",
    "FRAMES",
    "LOCKS",
    "MARKER",
    "MEASUREMENTS",
    "META",
    "MIGRATIONS_LOG",
    "MIRROR_LOG",
    "NAMES",
    "NAMES_LOG",
    "NAME_RE",
    "OBJECTS",
    "PROBES",
    "README",
    "ROOT_FILES",
    "SNAPSHOTS",
    "TMP_SUFFIX",
    "encode_marker",
    "encode_name_file",
    "frame_relpath",
    "frame_sha",
    "is_temp_name",
    "marker_problem",
    "measurement_filename",
    "measurement_sha",
    "meta_relpath",
    "meta_sha",
    "name_relpath",
    "object_relpath",
    "object_relpath_valid",
    "object_sha",
    "parse_name_file",
    "probe_filenames",
    "snapshot_filename",
    "validate_name",
]

FORMAT: Final = "prefix-registry"
FORMAT_VERSION: Final = 1

# Root entries.
MARKER: Final = "REGISTRY.json"
README: Final = "README.md"
NAMES_LOG: Final = "names.log"
MIRROR_LOG: Final = "mirror.log"
MIGRATIONS_LOG: Final = "migrations.log"
OBJECTS: Final = "objects"
META: Final = "meta"
NAMES: Final = "names"
MEASUREMENTS: Final = "measurements"
PROBES: Final = "probes"
SNAPSHOTS: Final = "snapshots"
FRAMES: Final = "frames"
LOCKS: Final = ".locks"

# What `verify` expects at the root: these directories and files, nothing else (temp files
# aside). Every directory is created by the store on first write.
EXPECTED_DIRS: Final = (OBJECTS, META, NAMES, MEASUREMENTS, PROBES, SNAPSHOTS, FRAMES, LOCKS)
ROOT_FILES: Final = frozenset({MARKER, README, NAMES_LOG, MIRROR_LOG, MIGRATIONS_LOG})

# Temp files of the durable writers: `.<target>.<random>.tmp`, in the target's directory.
TMP_SUFFIX: Final = ".tmp"

NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA_LIKE: Final = re.compile(r"[0-9A-Fa-f]{8,64}")
_STAMP: Final = re.compile(r"\d{8}T\d{6}\.\d{6}Z")


def is_temp_name(name: str) -> bool:
    """True for a durable writer's temp file name (`.<target>.<random>.tmp`)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def _need_sha(sha: str) -> str:
    if not is_full_sha(sha):
        raise UsageError(f"not a sha256: {sha!r}")
    return sha


# -- the marker ------------------------------------------------------------------------------


def encode_marker(role: str, created: str) -> bytes:
    """The bytes of `REGISTRY.json` for a new root of `role` (origin or mirror)."""
    from prefixreg.core.jsonio import dumps_canonical

    if role not in ("origin", "mirror"):
        raise UsageError(f"a registry role is origin or mirror, not {role!r}")
    marker = {"format": FORMAT, "version": FORMAT_VERSION, "role": role, "created": created}
    return dumps_canonical(marker) + b"\n"


def marker_problem(data: Mapping[str, object]) -> tuple[str, str] | None:
    """What is wrong with a parsed `REGISTRY.json`, as (kind, message), or None.

    kind: `foreign` (not a prefix registry marker), `newer` (a format this code does not
    understand), `corrupt` (a bad version or role field).
    """
    if data.get("format") != FORMAT:
        return "foreign", "not a prefix registry marker"
    version = data.get("version")
    if type(version) is not int:
        return "corrupt", "'version' must be an integer"
    if version > FORMAT_VERSION:
        return "newer", (
            f"registry format {version} is newer than this prefixreg understands ({FORMAT_VERSION})"
        )
    if data.get("role") not in ("origin", "mirror"):
        return "corrupt", "'role' must be origin or mirror"
    return None


# -- objects and meta ------------------------------------------------------------------------


def object_relpath(sha: str) -> str:
    """`objects/<aa>/<sha>.txt`, where <aa> is the sha's first two hex digits."""
    return object_relpath_valid(_need_sha(sha))


def object_relpath_valid(sha: str) -> str:
    """`object_relpath` for a sha the caller has already validated (the verified-read hot
    path checks it once, not twice)."""
    return f"{OBJECTS}/{sha[:2]}/{sha}.txt"


def object_sha(relpath: str) -> str | None:
    """The sha that `objects/<aa>/<sha>.txt` stands for, or None for any other path."""
    parts = relpath.split("/")
    if len(parts) != 3 or parts[0] != OBJECTS or not parts[2].endswith(".txt"):
        return None
    sha = parts[2].removesuffix(".txt")
    return sha if is_full_sha(sha) and sha[:2] == parts[1] else None


def meta_relpath(sha: str) -> str:
    """`meta/<sha>.json`."""
    return f"{META}/{_need_sha(sha)}.json"


def meta_sha(relpath: str) -> str | None:
    """The sha of `meta/<sha>.json`, or None for any other path."""
    parts = relpath.split("/")
    if len(parts) != 2 or parts[0] != META or not parts[1].endswith(".json"):
        return None
    sha = parts[1].removesuffix(".json")
    return sha if is_full_sha(sha) else None


# -- names ----------------------------------------------------------------------------------


def validate_name(name: object) -> str:
    """Check a name for a new move (DESIGN §3) and return it.

    Raises:
        InvalidNameError: bad characters, a leading dot or dash, too long, or 8-64 hex
            digits (a name must never read as a sha reference and shadow an object).
    """
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(
            f"invalid name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit"
        )
    if _SHA_LIKE.fullmatch(name) is not None:
        raise InvalidNameError(
            f"invalid name {name!r}: 8-64 hex digits would read as a sha reference"
        )
    return name


def is_sha_like_name(name: str) -> bool:
    """True for a name that reads as a sha reference (allowed before format rules tightened;
    still resolved, and reported by verify)."""
    return _SHA_LIKE.fullmatch(name) is not None


def name_relpath(name: object) -> str:
    """`names/<name>`, for any name the name rule accepts (old sha-like names included)."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(f"invalid name {name!r}")
    return f"{NAMES}/{name}"


def encode_name_file(sha: str) -> bytes:
    """The contents of a name file: 64 lowercase hex digits and a newline."""
    return _need_sha(sha).encode("ascii") + b"\n"


def parse_name_file(raw: bytes) -> str | None:
    """The sha a name file holds, or None when it is not exactly `<64 hex>\\n`."""
    if len(raw) != 65 or not raw.endswith(b"\n"):
        return None
    text = raw[:64].decode("ascii", errors="replace")
    return text if is_full_sha(text) else None


# -- records --------------------------------------------------------------------------------


def measurement_filename(sha: str, stamp: str) -> str:
    """`<sha>-<ts>.json` inside `measurements/` (ts: UTC `%Y%m%dT%H%M%S.%fZ`)."""
    return f"{_need_sha(sha)}-{stamp}.json"


def measurement_sha(filename: str) -> str | None:
    """The prefix sha a measurement file name starts with, or None if it is not one."""
    if not filename.endswith(".json") or len(filename) < 66 or filename[64] != "-":
        return None
    sha = filename[:64]
    return sha if is_full_sha(sha) else None


def probe_filenames(stamp: str) -> tuple[str, str]:
    """The receipt and the verdict of one probe: `<ts>.json` and `<ts>.md` in `probes/`."""
    if _STAMP.fullmatch(stamp) is None:
        raise UsageError(f"not a UTC stamp: {stamp!r}")
    return f"{stamp}.json", f"{stamp}.md"


def snapshot_filename(sha: str, build_id: str) -> str:
    """`<sha>-<build>.json` inside `snapshots/`: one KV snapshot record per prefix and build."""
    if re.fullmatch(r"[0-9a-f]{16}", build_id) is None:
        raise UsageError(f"not a build id: {build_id!r}")
    return f"{_need_sha(sha)}-{build_id}.json"


def frame_relpath(sha: str) -> str:
    """`frames/<sha>.json`: a frame record (`prefixreg.core.frame`), named by its own sha."""
    return f"{FRAMES}/{_need_sha(sha)}.json"


def frame_sha(relpath: str) -> str | None:
    """The sha of `frames/<sha>.json`, or None for any other path."""
    parts = relpath.split("/")
    if len(parts) != 2 or parts[0] != FRAMES or not parts[1].endswith(".json"):
        return None
    sha = parts[1].removesuffix(".json")
    return sha if is_full_sha(sha) else None

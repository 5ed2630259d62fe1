"""The registry on disk: objects, meta records, names, measurements; verify-at-use.

Layout (format version 1, DESIGN §3)::

    REGISTRY.json  README.md  objects/<aa>/<sha256>.txt  meta/<sha256>.json
    names/<name>  names.log  measurements/<sha256>-<ts>.json  probes/  mirror.log  .locks/

Invariants:
- Every read of an object re-hashes the bytes it returns; a mismatch raises
  `IntegrityError` and nothing is returned. There is no flag that skips this.
- Objects are published with no-overwrite links and are never rewritten; adding existing
  content re-verifies the object and refreshes its mtime.
- Write order is object, then meta, then name: a crash can leave an object without meta
  (reported by `verify` as incomplete, repaired by adding again) or a temp file (a stray),
  never a meta record or a name whose object is missing.
- Name moves are compare-and-swap under the registry lock and journalled to `names.log`,
  one line per move.
- A directory is only written into if it is empty or carries `REGISTRY.json`.
- A mirror (role `mirror`) is written only by `prefixreg mirror` (rsync): `add`,
  `move_name` and `write_measurement` refuse it with a `UsageError`, since the next mirror
  run would silently delete whatever they wrote.
- No symlink inside the registry is followed: reads open every component below the root
  with `O_NOFOLLOW`, writes check the directories they write into first. The root itself
  may be a symlink (a user's choice, e.g. a moved home).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

from prefixreg.core.digest import is_full_sha, looks_like_sha, object_sha, parse_abbrev, sha256_hex
from prefixreg.core.errors import (
    AmbiguousRefError,
    CorruptRecordError,
    IntegrityError,
    InvalidContentError,
    InvalidDigestError,
    InvalidNameError,
    LockTimeoutError,
    PrefixregError,
    RefNotFoundError,
    RegistryLocationError,
    UsageError,
)
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.core.prefix import Prefix
from prefixreg.registry import fsutil

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement, Meta, NameMove
    from prefixreg.registry.verify import VerifyReport

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "NameConflictError",
    "ObjectInfo",
    "Registry",
    "iso_utc",
    "stamp_utc",
    "utc_now",
    "validate_name",
]

FORMAT: Final = "prefix-registry"
FORMAT_VERSION: Final = 1
MARKER: Final = "REGISTRY.json"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_UNSET: Final = object()
_README = """\
# prefix registry

This directory is a prefixreg registry (format {version}): a content-addressed store of
LLM prompt prefixes. `objects/<aa>/<sha256>.txt` holds the exact bytes of each prefix and
`sha256sum` of each file prints its own name. Do not edit files here by hand: use
`prefixreg` (`prefixreg verify` checks everything).
"""


class NameConflictError(UsageError):
    """A compare-and-swap name move found the name pointing somewhere else."""


def utc_now() -> float:
    """The current time as a Unix timestamp (one place, so records agree on the clock)."""
    return time.time()


def _split(moment: float) -> tuple[time.struct_time, int]:
    # Round once to whole microseconds, then split: rounding the fraction alone could give
    # 1,000,000 and wrap to 0 without carrying into the seconds.
    seconds, micros = divmod(round(moment * 1_000_000), 1_000_000)
    return time.gmtime(seconds), micros


def iso_utc(moment: float) -> str:
    """ISO 8601 UTC with microseconds: `2026-11-29T12:48:17.123456Z`."""
    when, micros = _split(moment)
    return time.strftime("%Y-%m-%dT%H:%M:%S", when) + f".{micros:06d}Z"


def stamp_utc(moment: float) -> str:
    """The file-name timestamp of DESIGN §3: UTC `%Y%m%dT%H%M%S.%fZ`."""
    when, micros = _split(moment)
    return time.strftime("%Y%m%dT%H%M%S", when) + f".{micros:06d}Z"


def validate_name(name: str) -> str:
    """Check a name against the rules (DESIGN §3) and return it.

    Raises:
        InvalidNameError: bad characters, leading dot/dash, too long, or 64 hex digits.
    """
    if NAME_RE.fullmatch(name) is None:
        raise InvalidNameError(
            f"invalid name {name!r}: use 1-128 of [A-Za-z0-9._-], starting with a letter or digit"
        )
    if is_full_sha(name.lower()):
        raise InvalidNameError(f"invalid name {name!r}: 64 hex digits would read as a sha256")
    return name


class ObjectInfo(NamedTuple):
    """One object as `ls` shows it: from its meta record and the names pointing at it."""

    sha256: str
    bytes: int | None
    created: str | None
    note: str | None
    names: tuple[str, ...]


class Registry:
    """A registry rooted at `root`. Nothing is created until the first write.

    Args:
        root: the registry directory.
        lock_timeout: seconds to wait for the registry lock before `LockTimeoutError`.

    Raises:
        RegistryLocationError: `root` is a file, a non-empty directory without
            `REGISTRY.json`, or a registry of a newer format.
    """

    def __init__(self, root: Path | str, *, lock_timeout: float = 30.0) -> None:
        self.root = Path(root)
        # Plain strings for the hot read path (no Path arithmetic per verified read).
        self._root_s = str(self.root)
        self._objects = f"{self._root_s}/objects"
        self.lock_timeout = lock_timeout
        self._marker: dict[str, object] | None = None
        self._check_location()

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    # -- location and marker -------------------------------------------------------------

    def _check_location(self) -> bool:
        """Refuse a root that is not (or cannot become) a registry; True if it is one."""
        root = self.root
        try:
            st = root.lstat()
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            # A symlinked root is a user's choice (e.g. a moved home); follow it once.
            try:
                st = root.stat()
            except FileNotFoundError:
                raise RegistryLocationError(f"{root}: dangling symlink") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RegistryLocationError(f"{root}: is a file, not a registry directory")
        if (root / MARKER).exists() or (root / MARKER).is_symlink():
            self._load_marker()
            return True
        others = [p.name for p in root.iterdir() if not p.name.startswith(f".{MARKER}.")]
        if others:
            raise RegistryLocationError(
                f"{root}: holds files but no {MARKER}; refusing to use it as a registry",
                hint="point --registry or PREFIXREG_HOME at an empty or new directory",
            )
        return False

    def _load_marker(self) -> dict[str, object]:
        path = self.root / MARKER
        data = loads_object(fsutil.read_nofollow(path), path=path)
        if data.get("format") != FORMAT:
            raise RegistryLocationError(f"{path}: not a prefix registry marker")
        version = data.get("version")
        if type(version) is not int:
            raise CorruptRecordError(f"{path}: 'version' must be an integer", path=path)
        if version > FORMAT_VERSION:
            raise RegistryLocationError(
                f"{self.root}: registry format {version} is newer than this prefixreg "
                f"understands ({FORMAT_VERSION})",
                hint="upgrade prefixreg",
            )
        if data.get("role") not in ("origin", "mirror"):
            raise CorruptRecordError(f"{path}: 'role' must be origin or mirror", path=path)
        self._marker = dict(data)
        return self._marker

    @property
    def exists(self) -> bool:
        """True once the registry has been initialised (its marker exists)."""
        return self._marker is not None or (self.root / MARKER).exists()

    @property
    def role(self) -> str | None:
        """`origin` or `mirror`, or None before initialisation."""
        if self._marker is None and (self.root / MARKER).exists():
            self._load_marker()
        return None if self._marker is None else str(self._marker["role"])

    def init(self, *, role: Literal["origin", "mirror"] = "origin") -> None:
        """Create the registry if it does not exist yet (idempotent, safe to race)."""
        if self._marker is not None or self._check_location():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        marker = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "role": role,
            "created": iso_utc(utc_now()),
        }
        # The marker goes first, so a concurrent opener never sees files without it.
        fsutil.publish_new(self.root / MARKER, dumps_canonical(marker) + b"\n", mode=0o644)
        self._load_marker()
        for sub in ("objects", "meta", "names", "measurements", ".locks"):
            (self.root / sub).mkdir(exist_ok=True)
        fsutil.publish_new(
            self.root / "README.md", _README.format(version=FORMAT_VERSION).encode(), mode=0o644
        )

    def refuse_on_mirror(self, what: str) -> None:
        """Refuse a write API call on a mirror: the next mirror run would delete it."""
        if self.role == "mirror":
            raise UsageError(
                f"{self.root} is a mirror; refusing to {what} here (the next mirror run "
                "would delete it)",
                hint="write on the origin registry (the coordinator), then run prefixreg mirror",
            )

    @contextlib.contextmanager
    def lock(self, name: str = "registry") -> Iterator[None]:
        """Hold the registry's exclusive lock (`.locks/<name>.lock`)."""
        import filelock  # only writers need it

        self.init()
        lock = filelock.FileLock(str(self.root / ".locks" / f"{name}.lock"))
        try:
            lock.acquire(timeout=self.lock_timeout)
        except filelock.Timeout as exc:
            raise LockTimeoutError(
                f"could not take the {name} lock within {self.lock_timeout:g}s",
                path=self.root / ".locks" / f"{name}.lock",
            ) from exc
        try:
            yield
        finally:
            lock.release()

    # -- paths ---------------------------------------------------------------------------

    def object_path(self, sha: str) -> Path:
        """Where the object with this (validated) sha lives."""
        if not is_full_sha(sha):
            raise UsageError(f"not a sha256: {sha!r}")
        return self.root / "objects" / sha[:2] / f"{sha}.txt"

    def meta_path(self, sha: str) -> Path:
        if not is_full_sha(sha):
            raise UsageError(f"not a sha256: {sha!r}")
        return self.root / "meta" / f"{sha}.json"

    def name_path(self, name: str) -> Path:
        return self.root / "names" / validate_name(name)

    # -- objects -------------------------------------------------------------------------

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
            note: a free-text note kept in the meta record.
            source: a label saying where the content came from (a file name, "stdin").

        Raises:
            InvalidContentError: empty or not UTF-8. InvalidNameError: bad name.
            IntegrityError: an existing object with this sha no longer verifies.
            UsageError: the registry is a mirror (write on the origin).
        """
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        if not data:
            raise InvalidContentError("refusing to add an empty prefix")
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidContentError(
                f"content is not valid UTF-8 (byte {exc.start}): a prefix travels as a JSON string"
            ) from None
        if name is not None:
            validate_name(name)
        sha = sha256_hex(data)
        self.init()
        self.refuse_on_mirror("add a prefix")
        path = self.object_path(sha)
        # Never create or write through a symlinked directory (it would land outside).
        fsutil.check_no_symlinks(self.root, path.parent.parent)
        path.parent.mkdir(exist_ok=True)
        fsutil.check_no_symlinks(self.root, path.parent)
        # Look before writing: re-adding known content (the common case in a loop) then
        # costs a read and a hash, not a durable write; publish_new still settles races.
        for attempt in range(3):
            if not path.exists() and fsutil.publish_new(path, data, mode=0o444):
                break
            # Existing object: re-verify (never trust what is already there), then
            # refresh its mtime so age-based gc sees it as recently used.
            try:
                self._read_verified(sha)
                os.utime(path, follow_symlinks=False)
                break
            except (RefNotFoundError, FileNotFoundError):
                # A concurrent `gc --prune-unnamed` removed it between our look and the
                # refresh: publish it again rather than fail or return a missing sha.
                if attempt == 2:
                    raise
        self._write_meta(sha, len(data), note=note, source=source)
        if name is not None:
            self.move_name(name, sha)
        return sha

    def _write_meta(self, sha: str, size: int, *, note: str | None, source: str) -> None:
        path = self.meta_path(sha)
        fsutil.check_no_symlinks(self.root, path.parent)
        if note is None and path.exists():
            return
        # The on-disk form of `records.Meta`, built directly: the record classes are only
        # needed to read (and strictly validate) what is already there.
        record = {"sha256": sha, "bytes": size, "created": iso_utc(utc_now())}
        record |= {"source": source, "note": note}
        if fsutil.publish_new(path, dumps_canonical(record) + b"\n", mode=0o444) or note is None:
            return
        old = self.meta(sha)
        if old.note != note:
            updated = old.to_dict() | {"note": note}
            fsutil.replace_atomic(path, dumps_canonical(updated) + b"\n", mode=0o444)

    def _read_verified(self, sha: str) -> bytes:
        """The object's bytes, re-hashed and compared; `sha` must be validated already."""
        # A string path on the hot path: get() of a small prefix is dominated by overhead.
        path = f"{self._objects}/{sha[:2]}/{sha}.txt"
        try:
            data = fsutil.read_nofollow(path, root=self._root_s)
        except FileNotFoundError:
            raise RefNotFoundError(f"no prefix {sha}") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha:
            raise IntegrityError(
                f"{path}: content hashes to {actual}, expected {sha}; refusing to use it",
                path=Path(path),
                expected=sha,
                actual=actual,
            )
        return data

    def read_verified(self, sha: str) -> bytes:
        """The bytes of object `sha` (a full sha), re-hashed and compared.

        Raises:
            UsageError: not a full sha. RefNotFoundError: no such object.
            IntegrityError: the stored bytes do not hash to their sha (or are not a regular
                file reached without a symlink).
        """
        if not is_full_sha(sha):
            raise UsageError(f"not a sha256: {sha!r}")
        return self._read_verified(sha)

    def get_bytes(self, ref: str) -> bytes:
        """The exact, verified bytes of the prefix `ref` names.

        Raises:
            RefNotFoundError, AmbiguousRefError, InvalidDigestError: bad reference.
            IntegrityError: the stored bytes do not hash to their sha.
        """
        return self._read_verified(ref if is_full_sha(ref) else self.resolve(ref))

    def get(self, ref: str) -> Prefix:
        """The verified prefix `ref` names (a name, a sha, or an 8+ digit abbreviation)."""
        # A full sha needs no lookup: the verified read itself says whether it exists.
        sha, name = (ref, None) if is_full_sha(ref) else self._resolve(ref)
        return Prefix(sha, self._read_verified(sha), name)

    def meta(self, sha: str) -> Meta:
        """The meta record of `sha` (parsed strictly).

        Raises:
            RefNotFoundError: no meta record. CorruptRecordError: unreadable or wrong.
        """
        path = self.meta_path(sha)
        try:
            raw = fsutil.read_nofollow(path, root=self._root_s)
        except FileNotFoundError:
            raise RefNotFoundError(f"no meta record for {sha}") from None
        from prefixreg.core.records import Meta

        try:
            meta = Meta.from_dict(loads_object(raw, path=path))
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{path}: {exc}", path=path) from None
        if meta.sha256 != sha:
            raise CorruptRecordError(f"{path}: records sha {meta.sha256}", path=path)
        return meta

    def iter_shas(self) -> Iterator[str]:
        """Every object sha present (by file name; not verified), sorted."""
        objects = self.root / "objects"
        if not objects.is_dir():
            return
        for fan in sorted(objects.iterdir()):
            if not fan.is_dir() or fan.is_symlink():
                continue
            for entry in sorted(fan.iterdir()):
                sha = object_sha(fan.name, entry.name)
                if sha is not None:
                    yield sha

    def list_objects(self) -> list[ObjectInfo]:
        """Every object with its meta and names, oldest first (meta is parsed, bytes not read)."""
        by_sha: dict[str, list[str]] = {}
        for name, sha in self.names().items():
            by_sha.setdefault(sha, []).append(name)
        out = []
        for sha in self.iter_shas():
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
                )
            )
        out.sort(key=lambda o: (o.created or "", o.sha256))
        return out

    # -- references ----------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """Resolve a name, a full sha or a unique abbreviation (8+ hex) to a full sha.

        A name wins over an abbreviation that happens to be spelt the same.

        Raises:
            RefNotFoundError: nothing matches. AmbiguousRefError: several objects match.
            InvalidDigestError / InvalidNameError: the reference is neither form.
        """
        return self._resolve(ref)[0]

    def _resolve(self, ref: str) -> tuple[str, str | None]:
        """(sha, the name it was reached by or None)."""
        if is_full_sha(ref):
            if not self.object_path(ref).exists() and not self.object_path(ref).is_symlink():
                raise RefNotFoundError(f"no prefix {ref}")
            return ref, None
        if NAME_RE.fullmatch(ref) is not None and not is_full_sha(ref.lower()):
            sha = self._read_name(ref)
            if sha is not None:
                return sha, ref
            if not looks_like_sha(ref):
                raise RefNotFoundError(f"no prefix named {ref!r}")
        if not looks_like_sha(ref):
            raise InvalidDigestError(
                f"invalid reference {ref!r}: not a name, a sha256, or 8+ hex digits of one"
            )
        if len(ref) < 8:
            raise RefNotFoundError(
                f"no prefix named {ref!r}", hint="an abbreviated sha needs at least 8 hex digits"
            )
        abbrev = parse_abbrev(ref)
        if len(abbrev) == 64:
            return self._resolve(abbrev)
        fan = self.root / "objects" / abbrev[:2]
        matches = (
            sorted(
                p.name.removesuffix(".txt")
                for p in fan.iterdir()
                if p.name.startswith(abbrev) and p.name.endswith(".txt")
            )
            if fan.is_dir()
            else []
        )
        if not matches:
            raise RefNotFoundError(f"no prefix matches {ref!r}")
        if len(matches) > 1:
            raise AmbiguousRefError(
                f"{ref!r} matches {len(matches)} prefixes: "
                + ", ".join(m[:12] for m in matches[:5]),
                candidates=matches,
            )
        return matches[0], None

    # -- names ---------------------------------------------------------------------------

    def _read_name(self, name: str) -> str | None:
        path = self.root / "names" / name
        try:
            raw = fsutil.read_nofollow(path, root=self._root_s)
        except FileNotFoundError:
            return None
        text = raw.decode("ascii", errors="replace")
        if not (len(raw) == 65 and raw.endswith(b"\n") and is_full_sha(text[:64])):
            raise CorruptRecordError(f"{path}: not a sha256 line", path=path)
        return text[:64]

    def read_name(self, name: str) -> str | None:
        """The sha the name file `names/<name>` holds, or None when there is no such name.

        Raises:
            InvalidNameError: not a valid name. CorruptRecordError: not a sha line.
        """
        from prefixreg.registry.layout import name_relpath

        name_relpath(name)
        return self._read_name(name)

    def names(self) -> dict[str, str]:
        """Every name and the sha it points to, sorted by name."""
        directory = self.root / "names"
        if not directory.is_dir():
            return {}
        out: dict[str, str] = {}
        for entry in sorted(directory.iterdir()):
            if fsutil.is_temp_name(entry.name) or NAME_RE.fullmatch(entry.name) is None:
                continue
            sha = self._read_name(entry.name)
            if sha is not None:
                out[entry.name] = sha
        return out

    def move_name(self, name: str, ref: str, *, expect: object = _UNSET) -> NameMove | None:
        """Point `name` at the prefix `ref` resolves to; journal the move.

        Args:
            expect: compare-and-swap: the sha (or None for "unset") the name must point to
                now, else `NameConflictError`. Omit to move unconditionally (still atomic).

        Returns:
            The journalled move, or None if the name already pointed there.

        Raises:
            UsageError: the registry is a mirror (move names on the origin).
        """
        validate_name(name)
        self.refuse_on_mirror("move a name")
        sha = self.resolve(ref)
        self._read_verified(sha)  # never point a name at bytes that fail verification
        with self.lock():
            current = self._read_name(name)
            if expect is not _UNSET and current != expect:
                raise NameConflictError(
                    f"name {name!r} points to {current or 'nothing'}, not {expect or 'nothing'}"
                )
            if current == sha:
                return None
            # gc removes objects only under this lock: re-check that the object is still
            # there now that we hold it, or a name could end up pointing nowhere.
            if not self.object_path(sha).is_file():
                raise RefNotFoundError(f"no prefix {sha} (removed by gc meanwhile?)")
            fsutil.check_no_symlinks(self.root, self.root / "names")
            fsutil.replace_atomic(self.root / "names" / name, f"{sha}\n".encode(), mode=0o644)
            from prefixreg.core.records import NameMove

            move = NameMove(at=iso_utc(utc_now()), name=name, from_sha=current, to_sha=sha)
            fsutil.append_line(self.root / "names.log", dumps_canonical(move.to_dict()))
        return move

    def name_log(self) -> list[NameMove]:
        """Every journalled name move, oldest first."""
        path = self.root / "names.log"
        try:
            raw = fsutil.read_nofollow(path, root=self._root_s)
        except FileNotFoundError:
            return []
        from prefixreg.core.records import NameMove

        moves = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                moves.append(NameMove.from_dict(loads_object(line)))
            except CorruptRecordError as exc:
                raise CorruptRecordError(f"{path}:{lineno}: {exc}", path=path) from None
        return moves

    # -- measurements --------------------------------------------------------------------

    def write_measurement(self, measurement: Measurement) -> Path:
        """Write one measurement record; never overwrites an existing one.

        Raises:
            UsageError: the registry is a mirror (measure against the origin).
        """
        sha = measurement.sha256
        self.init()
        self.refuse_on_mirror("write a measurement")
        directory = self.root / "measurements"
        fsutil.check_no_symlinks(self.root, directory)
        data = dumps_canonical(measurement.to_dict()) + b"\n"
        for _ in range(100):
            path = directory / f"{sha}-{stamp_utc(utc_now())}.json"
            if fsutil.publish_new(path, data, mode=0o444):
                return path
        raise PrefixregError(f"could not find a free measurement file name for {sha}")

    def measurements(self, sha: str | None = None) -> list[Measurement]:
        """Measurement records (of one prefix, or all), oldest first.

        Raises:
            CorruptRecordError: a record that does not parse (fail closed).
        """
        directory = self.root / "measurements"
        if not directory.is_dir():
            return []
        pattern = f"{sha}-*.json" if sha is not None else "*.json"
        out = []
        for path in sorted(directory.glob(pattern)):
            if fsutil.is_temp_name(path.name):
                continue
            out.append(self._load_measurement(path))
        out.sort(key=lambda m: m.at)
        return out

    def _load_measurement(self, path: Path) -> Measurement:
        from prefixreg.core.records import Measurement

        try:
            raw = fsutil.read_nofollow(path, root=self._root_s)
            record = Measurement.from_dict(loads_object(raw, path=path))
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{path}: {exc}", path=path) from None
        if not path.name.startswith(record.sha256 + "-"):
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
        """
        from prefixreg.registry.layout import PROBES, probe_filenames

        self.init()
        directory = self.root / PROBES
        directory.mkdir(exist_ok=True)
        fsutil.check_no_symlinks(self.root, directory)
        for attempt in range(100):
            name = stamp if attempt == 0 else stamp_utc(utc_now())
            json_name, md_name = probe_filenames(name)
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
        Unreadable receipts are skipped (a receipt is history, not a budget)."""
        from prefixreg.registry.layout import PROBES

        directory = self.root / PROBES
        if not directory.is_dir():
            return []
        out = []
        for path in sorted(directory.glob("*.json"), reverse=True):
            if fsutil.is_temp_name(path.name):
                continue
            try:
                out.append((path, fsutil.read_nofollow(path, root=self._root_s)))
            except (OSError, PrefixregError):
                continue
        return out

    def append_mirror_log(self, line: bytes) -> None:
        """Append one JSON line to `mirror.log` (durably)."""
        from prefixreg.registry.layout import MIRROR_LOG

        fsutil.append_line(self.root / MIRROR_LOG, line)

    # -- verify --------------------------------------------------------------------------

    def verify(self) -> VerifyReport:
        """Check everything in the registry (see `prefixreg.registry.verify`)."""
        from prefixreg.registry.verify import verify_registry

        return verify_registry(self)

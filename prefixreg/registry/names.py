"""Names, references and the write-ahead name journal (`names.log`).

Invariants:
- A name moves with compare-and-swap under the registry lock, journal first: the
  `names.log` line `{"at","name","from","to"}` is written and fsynced before the name file
  is replaced. A failed journal write raises and leaves the name unmoved.
- After any crash, each name equals the `to` of its last journal line, except for a move
  interrupted between its journal line and its rename: then the name still holds that
  line's `from`. `journal_disagreements` lists every such name (and any other
  disagreement); `repair_names` completes an interrupted move when its object verifies, or
  rolls it back by journalling the name's current value.
- New names are never 8-64 hex digits (they would shadow a sha reference); such names
  from older versions still resolve, and `verify` warns about them.
- A reference is a name, a full sha, or a unique abbreviation of 8+ hex digits; a name
  wins over an abbreviation spelt the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from prefixreg.core.digest import is_full_sha, looks_like_sha, parse_abbrev
from prefixreg.core.errors import (
    AmbiguousRefError,
    CorruptRecordError,
    IntegrityError,
    InvalidDigestError,
    PrefixregError,
    RefNotFoundError,
    UsageError,
)
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.core.prefix import Prefix
from prefixreg.registry import fsutil, layout
from prefixreg.registry.clock import iso_utc, utc_now
from prefixreg.registry.objects import ObjectStore

if TYPE_CHECKING:
    from prefixreg.core.records import NameMove

__all__ = ["UNSET", "JournalDisagreement", "NameConflictError", "NamedStore"]

UNSET: Final = object()


class NameConflictError(UsageError):
    """A compare-and-swap name move found the name pointing somewhere else."""


@dataclass(frozen=True, slots=True)
class JournalDisagreement:
    """A name whose value is not the `to` of its last `names.log` line."""

    name: str
    current: str | None  # what names/<name> holds (None: no such file)
    last: NameMove | None  # its last journal line (None: never journalled)

    @property
    def interrupted(self) -> bool:
        """True for a move whose journal line was written but whose rename was not."""
        return self.last is not None and self.current == self.last.from_sha

    def describe(self) -> str:
        if self.last is None:
            return f"points to {self.current} but names.log has no move of it"
        if self.interrupted:
            return (
                f"interrupted move: names.log moves it to {self.last.to_sha} but it still "
                f"holds {self.current or 'nothing'}; run verify --repair to complete it"
            )
        return (
            f"holds {self.current or 'nothing'}, names.log's last move says {self.last.to_sha}; "
            "run verify --repair to journal its current value"
        )


class NamedStore(ObjectStore):
    """Objects plus names: resolution, journalled moves, journal checks and repair."""

    def name_path(self, name: str) -> Path:
        return self.path(layout.name_relpath(name))

    # -- reading names --------------------------------------------------------------------

    def _read_name(self, name: str) -> str | None:
        rel = layout.name_relpath(name)
        try:
            raw = self.read_file(rel)
        except FileNotFoundError:
            return None
        sha = layout.parse_name_file(raw)
        if sha is None:
            raise CorruptRecordError(f"{self.root / rel}: not a sha256 line", path=self.root / rel)
        return sha

    def read_name(self, name: str) -> str | None:
        """The sha the name file `names/<name>` holds, or None when there is no such name.

        Raises:
            InvalidNameError: not a valid name. CorruptRecordError: not a sha line.
            IntegrityError: the name file (or `names/`) is a symlink or not a regular file.
        """
        return self._read_name(name)

    def names(self) -> dict[str, str]:
        """Every name and the sha it points to, sorted by name (never following a link).

        Raises:
            IntegrityError: `names/` or a name file is a symlink or not a regular file.
        """
        out: dict[str, str] = {}
        for entry, _kind in self.entries(layout.NAMES):
            if layout.is_temp_name(entry) or layout.NAME_RE.fullmatch(entry) is None:
                continue
            sha = self._read_name(entry)  # refuses a symlink or a non-file by itself
            if sha is not None:
                out[entry] = sha
        return out

    def name_log(self) -> list[NameMove]:
        """Every journalled name move, oldest first."""
        from prefixreg.core.records import NameMove

        path = self.root / layout.NAMES_LOG
        try:
            raw = self.read_file(layout.NAMES_LOG)
        except FileNotFoundError:
            return []
        moves = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                moves.append(NameMove.from_dict(loads_object(line)))
            except CorruptRecordError as exc:
                raise CorruptRecordError(f"{path}:{lineno}: {exc}", path=path) from None
        return moves

    # -- references -----------------------------------------------------------------------

    def resolve(self, ref: str) -> str:
        """Resolve a name, a full sha or a unique abbreviation (8+ hex) to a full sha.

        Raises:
            RefNotFoundError: nothing matches. AmbiguousRefError: several objects match.
            InvalidDigestError / InvalidNameError: the reference is neither form.
        """
        return self._resolve(ref)[0]

    def _resolve(self, ref: str, *, frames: bool = False) -> tuple[str, str | None]:
        """(sha, the name it was reached by or None). With `frames`, a sha or an
        abbreviation may also name a frame record (`frames/<sha>.json`)."""
        given: object = ref  # the API boundary: callers may pass anything
        if not isinstance(given, str):
            raise UsageError(f"a reference is a string, not {type(given).__name__}")
        what = "prefix or frame" if frames else "prefix"
        if is_full_sha(ref):
            if self.lstat(layout.object_relpath(ref)) is None and not (
                frames and self.lstat(layout.frame_relpath(ref)) is not None
            ):
                raise RefNotFoundError(f"no {what} {ref}")
            return ref, None
        if layout.NAME_RE.fullmatch(ref) is not None and not is_full_sha(ref.lower()):
            sha = self._read_name(ref)
            if sha is not None:
                return sha, ref
            if not looks_like_sha(ref):
                raise RefNotFoundError(f"no {what} named {ref!r}")
        if not looks_like_sha(ref):
            raise InvalidDigestError(
                f"invalid reference {ref!r}: not a name, a sha256, or 8+ hex digits of one"
            )
        if len(ref) < 8:
            raise RefNotFoundError(
                f"no {what} named {ref!r}", hint="an abbreviated sha needs at least 8 hex digits"
            )
        abbrev = parse_abbrev(ref)
        if len(abbrev) == 64:
            return self._resolve(abbrev, frames=frames)
        matches = self._abbrev_matches(abbrev)
        if frames:
            matches += [s for s in self._frame_shas() if s.startswith(abbrev)]
        if not matches:
            raise RefNotFoundError(f"no {what} matches {ref!r}")
        if len(matches) > 1:
            raise AmbiguousRefError(
                f"{ref!r} matches {len(matches)} {'heads' if frames else 'prefixes'}: "
                + ", ".join(m[:12] for m in matches[:5]),
                candidates=matches,
            )
        return matches[0], None

    def _frame_shas(self) -> list[str]:
        """Every frame sha present (by file name; not verified), sorted."""
        out = []
        for entry, kind in self.entries(layout.FRAMES):
            sha = layout.frame_sha(f"{layout.FRAMES}/{entry}")
            if kind == "file" and sha is not None:
                out.append(sha)
        return out

    def get_bytes(self, ref: str) -> bytes:
        """The exact, verified bytes of the prefix `ref` names.

        Raises:
            RefNotFoundError, AmbiguousRefError, InvalidDigestError: bad reference.
            IntegrityError: the stored bytes do not hash to their sha.
        """
        return self._read_verified(ref if is_full_sha(ref) else self.resolve(ref))

    def get(self, ref: str) -> Prefix:
        """The verified prefix `ref` names (a name, a sha, or an 8+ digit abbreviation).
        A reference to a frame is refused (`head` takes both)."""
        # A full sha needs no lookup: the verified read itself says whether it exists.
        sha, name = (ref, None) if is_full_sha(ref) else self._resolve(ref)
        try:
            return Prefix(sha, self._read_verified(sha), name)
        except RefNotFoundError:
            if self.lstat(layout.frame_relpath(sha)) is None:
                raise
            raise RefNotFoundError(
                f"{ref!r} names frame {sha[:12]}, not a prefix",
                hint="a frame is a head: use head()",
            ) from None

    # -- moving names ---------------------------------------------------------------------

    def move_name(
        self, name: str, ref: str, *, expect: object = UNSET, force: bool = False
    ) -> NameMove | None:
        """Point `name` at the prefix `ref` resolves to, journal first.

        Args:
            expect: compare-and-swap: the sha (or None for "unset") the name must point to
                now, else `NameConflictError`. Omit to move unconditionally (still atomic).
            force: move a name that points at a frame to a prefix (else `NameConflictError`).

        Returns:
            The journalled move, or None if the name already pointed there.

        Raises:
            InvalidNameError: not a valid name for a new move (8-64 hex digits included).
            UsageError: the registry is a mirror (move names on the origin).
            IntegrityError: `names.log`, `names/` or `.locks/` is a symlink.
            PrefixregError: the journal could not be written (the name is not moved).
        """
        layout.validate_name(name)
        self.refuse_on_mirror("move a name")
        sha = self.resolve(ref)
        self._read_verified(sha)  # never point a name at bytes that fail verification
        with self.lock():
            current = self._read_name(name)
            if expect is not UNSET and current != expect:
                raise NameConflictError(
                    f"name {name!r} points to {current or 'nothing'}, not {expect or 'nothing'}"
                )
            if current == sha:
                return None
            self._refuse_kind_change(name, current, "prefix", force)
            # gc removes objects only under this lock: re-check that the object is still
            # there now that we hold it, or a name could end up pointing nowhere.
            self._read_verified(sha)
            return self._journalled_move(name, current, sha)

    def point_name(
        self, name: str, sha: str, *, check: Callable[[], object], force: bool = False
    ) -> NameMove | None:
        """Point `name` at `sha` (a record that is not an object, such as a frame), journal
        first, under the lock; `check()` verifies the target before and again under the lock
        (it raises to refuse). Returns the move, or None if the name already pointed there.
        """
        layout.validate_name(name)
        self.refuse_on_mirror("move a name")
        check()
        with self.lock():
            current = self._read_name(name)
            if current == sha:
                return None
            self._refuse_kind_change(name, current, "frame", force)
            check()
            return self._journalled_move(name, current, sha)

    def _refuse_kind_change(self, name: str, current: str | None, kind: str, force: bool) -> None:
        """A name that holds a prefix is not silently moved to a frame, nor back: the
        loop reading it would send another kind of head."""
        if current is None or force:
            return
        is_frame = self.lstat(layout.frame_relpath(current)) is not None
        if is_frame == (kind == "frame"):
            return
        was = "frame" if is_frame else "prefix"
        raise NameConflictError(
            f"name {name!r} points to {was} {current[:12]}; moving it to a {kind} changes "
            "what the loop sends",
            hint="pass --force (force=True) to move it anyway",
        )

    def _journalled_move(self, name: str, current: str | None, sha: str) -> NameMove:
        """Journal the move durably, then replace the name file. Caller holds the lock."""
        from prefixreg.core.records import NameMove

        self.writable_dir(layout.NAMES)
        move = NameMove(at=iso_utc(utc_now()), name=name, from_sha=current, to_sha=sha)
        self._append_journal(move, what=f"{name} not moved")
        self._write_name_file(name, sha)
        return move

    def _write_name_file(self, name: str, sha: str) -> None:
        path = self.writable_dir(layout.NAMES) / name
        fsutil.replace_atomic(path, layout.encode_name_file(sha), mode=0o644)

    def _append_journal(self, move: NameMove, *, what: str) -> None:
        try:
            fsutil.append_line(
                self.root / layout.NAMES_LOG, dumps_canonical(move.to_dict()), root=self.root
            )
        except IntegrityError as exc:
            raise IntegrityError(f"{exc}; {what}", path=self.root / layout.NAMES_LOG) from None
        except OSError as exc:
            raise PrefixregError(
                f"{self.root / layout.NAMES_LOG}: cannot write the name journal "
                f"({exc.strerror or exc}); {what}"
            ) from None

    # -- journal checks and repair ----------------------------------------------------------

    def journal_disagreements(self) -> list[JournalDisagreement]:
        """Every name whose value is not the `to` of its last `names.log` line (and every
        journalled name whose file is gone), sorted by name."""
        last: dict[str, NameMove] = {}
        for move in self.name_log():
            last[move.name] = move
        current = self.names()
        out = []
        for name in sorted(set(current) | set(last)):
            final = last.get(name)
            value = current.get(name)
            if final is None or final.to_sha != value:
                out.append(JournalDisagreement(name, value, final))
        return out

    def repair_names(self, *, check: Callable[[str], object] | None = None) -> list[str]:
        """Make every name agree with its journal again, under the lock; what was done.

        An interrupted move (the name still holds its last line's `from`) is completed when
        the line's `to` verifies (`check(sha)`, which raises to refuse; by default the
        object is re-hashed, and a caller that knows frames checks those too), else rolled
        back by journalling the name's current value. Any other disagreement journals the
        name's current value (the name file is what readers use); a journalled name whose
        file is gone is restored to the line's `to` if it verifies.
        """
        from prefixreg.core.records import NameMove

        self.refuse_on_mirror("repair names")
        done: list[str] = []
        with self.lock():
            for d in self.journal_disagreements():
                target = d.last.to_sha if d.last is not None else None
                if target is not None and (d.interrupted or d.current is None):
                    try:
                        (check or self._read_verified)(target)
                    except (IntegrityError, RefNotFoundError):
                        pass
                    else:
                        self._write_name_file(d.name, target)
                        done.append(f"{d.name}: completed the move to {target}")
                        continue
                if d.current is None:
                    done.append(f"{d.name}: not repaired ({target} is missing or corrupt)")
                    continue
                move = NameMove(
                    at=iso_utc(utc_now()), name=d.name, from_sha=target, to_sha=d.current
                )
                self._append_journal(move, what=f"{d.name} not repaired")
                done.append(f"{d.name}: journalled its current value {d.current}")
        return done

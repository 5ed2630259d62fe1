"""`Names` and `Records`: name files and their write-ahead journal (`names.log`), and the
history verbs keep: measurements and probe receipts, read here, written by `Registry` (frame
records live with the objects, snapshot records in `snapshots`).

Invariants:
- A name moves with compare-and-swap under the registry lock, journal first: the line
  `{"at","name","from","to"}` (appended whole or not at all) is durable before the name file
  is replaced; if that write fails (a full disk), the line is taken back under the lock.
- A line is committed once its newline is durable: `log` skips an unterminated last line and
  `repair` cuts it off.
- After any crash each name equals the `to` of its last journal line, except after a move
  interrupted between its line and its rename (it still holds the line's `from`), which
  `disagreements` lists; `repair` completes such a move (or restores a journalled name whose
  file is gone) when its target verifies, else journals the name's current value.
- A name that holds a prefix is not moved to a frame, nor back, unless forced: the loop
  reading it would send another kind of head. `precheck` refuses such a move before the
  caller writes anything; the move checks again under the lock.
- A measurement is read strictly, with the depth-capped JSON reader: one whose file name
  disagrees with its sha, or that does not parse, is a `CorruptRecordError` (fail closed).
- A probe receipt lists every call with the sha256 of what it sent: `receipt_refs` reads
  them, so `gc --prune-unnamed` keeps the slices a receipt names, as it keeps a name's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from prefixreg.core import errors
from prefixreg.core.digest import is_full_sha
from prefixreg.core.jsonio import dumps_canonical, loads_object
from prefixreg.registry import fsutil, layout
from prefixreg.registry.disk import Disk, LegacyRecordError

if TYPE_CHECKING:
    from prefixreg.core.records import Measurement, NameMove

UNSET: Final = object()
Check = Callable[[str], object]  # verifies a target sha, raising to refuse it


class NameConflictError(errors.UsageError):
    """A compare-and-swap name move found the name pointing somewhere else."""


@dataclass(frozen=True, slots=True)
class JournalDisagreement:
    """A name whose value (`current`, None: no file) is not the `to` of its `last` line."""

    name: str
    current: str | None
    last: NameMove | None

    @property
    def interrupted(self) -> bool:
        """True for a move whose journal line was written but whose rename was not."""
        return self.last is not None and self.current == self.last.from_sha

    def describe(self) -> str:
        if self.last is None:
            return f"points to {self.current} but names.log has no move of it"
        held, to = self.current or "nothing", self.last.to_sha
        if self.interrupted:
            moved = f"interrupted move: names.log moves it to {to} but it still holds {held}"
            return f"{moved}; run verify --repair to complete it"
        fix = "run verify --repair to journal its current value"
        return f"holds {held}, names.log's last move says {to}; {fix}"


class Names:
    """The names below a `Disk`; `lock()` is the registry lock every move holds."""

    def __init__(self, disk: Disk, lock: Callable[[], AbstractContextManager[None]]) -> None:
        self._disk = disk
        self._lock = lock
        self._log = disk.path(layout.NAMES_LOG)

    def read(self, name: str) -> str | None:
        """The sha `names/<name>` holds, or None. Raises: InvalidNameError; CorruptRecordError
        (not a sha line); IntegrityError (a symlink, not a regular file)."""
        rel = layout.name_relpath(name)
        try:
            sha = layout.parse_name_file(self._disk.read(rel))
        except FileNotFoundError:
            return None
        if sha is None:
            path = self._disk.path(rel)
            raise errors.CorruptRecordError(f"{path}: not a sha256 line", path=path)
        return sha

    def all(self) -> dict[str, str]:
        """Every name and the sha it points to, sorted by name."""
        out: dict[str, str] = {}
        for entry, _kind in self._disk.entries(layout.NAMES):
            if not layout.is_temp_name(entry) and layout.NAME_RE.fullmatch(entry) is not None:
                sha = self.read(entry)  # refuses a symlink or a non-file by itself
                if sha is not None:
                    out[entry] = sha
        return out

    def did_you_mean(self, ref: str) -> str:
        """`; did you mean 'a' or 'b'?` naming the existing names closest to `ref` (difflib,
        from the directory listing alone: nothing is read), or "" when none is close."""
        import difflib

        try:
            entries = self._disk.entries(layout.NAMES)
        except errors.IntegrityError:  # a symlinked names/: the lookup itself says so
            return ""
        names = [e for e, kind in entries if kind == "file" and not layout.is_temp_name(e)]
        close = difflib.get_close_matches(ref, names, n=3, cutoff=0.6)
        if not close:
            return ""
        quoted = [repr(name) for name in close]
        listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        return f"; did you mean {listed}?"

    def log(self) -> list[NameMove]:
        """Every committed name move, oldest first (an unterminated last line is not one)."""
        from prefixreg.core.records import NameMove

        try:
            raw = self._disk.read(layout.NAMES_LOG)
        except FileNotFoundError:
            raw = b""
        moves = []
        for lineno, line in enumerate(raw[: raw.rfind(b"\n") + 1].splitlines(), 1):
            if line.strip():
                try:
                    moves.append(NameMove.from_dict(loads_object(line)))
                except errors.CorruptRecordError as exc:
                    where = f"{self._log}:{lineno}"
                    raise errors.CorruptRecordError(f"{where}: {exc}", path=self._log) from None
        return moves

    def is_frame(self, sha: str) -> bool:
        return self._disk.lstat(layout.frame_relpath(sha)) is not None

    def move(
        self, name: str, sha: str, check: Check, *, expect: object = UNSET, force: bool = False
    ) -> NameMove | None:
        """Point `name` at `sha`, which `check` verifies again under the lock (gc removes
        objects only under it); None if it already pointed there. Raises as `Registry.move_name`."""
        with self._lock():
            current = self.read(name)
            if expect is not UNSET and current != expect:
                why = f"name {name!r} points to {current or 'nothing'}, not {expect or 'nothing'}"
                raise NameConflictError(why)
            if current == sha:
                return None
            if not force:
                self._refuse_kind_change(name, current, to_frame=self.is_frame(sha))
            check(sha)
            move, start = self._append(name, current, sha, what=f"{name} not moved")
            try:
                self._write(name, sha)
            except BaseException:
                if self.read(name) == current:  # not moved: the line goes too, under the lock
                    fsutil.truncate(self._log, start, root=self._disk.root)
                raise
            return move

    def precheck(self, name: str, *, to_frame: bool, force: bool = False) -> None:
        """Refuse now, before the caller writes its target, a move `move` would refuse for
        its kind (`to_frame`: the target is a frame). Not under the lock: `move` checks again
        under it, so a name moved meanwhile is still refused there. Raises NameConflictError."""
        if not force:
            self._refuse_kind_change(name, self.read(name), to_frame=to_frame)

    def _refuse_kind_change(self, name: str, current: str | None, *, to_frame: bool) -> None:
        """NameConflictError if `name` holds `current`, a head of the other kind."""
        if current is None or self.is_frame(current) == to_frame:
            return
        was, kind = ("prefix", "frame") if to_frame else ("frame", "prefix")
        why = f"name {name!r} points to {was} {current[:12]}; moving it to a {kind}"
        hint = "pass --force (force=True) to move it anyway"
        raise NameConflictError(f"{why} changes what the loop sends", hint=hint)

    def _write(self, name: str, sha: str) -> None:
        path = self._disk.mkdir(layout.NAMES) / name
        fsutil.replace_atomic(path, layout.encode_name_file(sha), mode=0o644)

    def _append(
        self, name: str, from_sha: str | None, to_sha: str, *, what: str
    ) -> tuple[NameMove, int]:
        """Journal a move now: the move and the offset its line starts at."""
        from prefixreg.core.records import NameMove

        at = layout.iso_utc(layout.utc_now())
        move = NameMove(at=at, name=name, from_sha=from_sha, to_sha=to_sha)
        try:
            line = dumps_canonical(move.to_dict())
            return move, fsutil.append_line(self._log, line, root=self._disk.root)
        except errors.IntegrityError as exc:
            refused = errors.IntegrityError(f"{exc}; {what}", path=self._log)
            refused.hint = exc.hint
            raise refused from None
        except OSError as exc:
            why = f"{self._log}: cannot write the name journal ({exc.strerror or exc}); {what}"
            raise errors.PrefixregError(why) from None

    def disagreements(self) -> list[JournalDisagreement]:
        """Every name (file or journalled) whose value is not its last line's `to`, sorted."""
        last = {move.name: move for move in self.log()}
        current = self.all()
        out = []
        for name in sorted(set(current) | set(last)):
            final, value = last.get(name), current.get(name)
            if final is None or final.to_sha != value:
                out.append(JournalDisagreement(name, value, final))
        return out

    def repair(self, check: Check) -> list[str]:
        """Align every name with its journal, under the lock (module invariants); what was done."""
        with self._lock():
            done = self._disk.cut_tail(layout.NAMES_LOG)
            for d in self.disagreements():
                target = d.last.to_sha if d.last is not None else None
                if target is not None and (d.interrupted or d.current is None):
                    try:
                        check(target)
                    except (errors.IntegrityError, errors.RefNotFoundError):
                        pass
                    else:
                        self._write(d.name, target)
                        done.append(f"{d.name}: completed the move to {target}")
                        continue
                if d.current is None:
                    done.append(f"{d.name}: not repaired ({target} is missing or corrupt)")
                else:
                    self._append(d.name, target, d.current, what=f"{d.name} not repaired")
                    done.append(f"{d.name}: journalled its current value {d.current}")
        return done


class Records:
    """Measurements and probe receipts below a `Disk`, read (`Registry` writes them)."""

    def __init__(self, disk: Disk) -> None:
        self._disk = disk

    def measurements(self, sha: str | None = None) -> list[Measurement]:
        if sha is not None:
            layout.need_sha(sha)
        out = []
        for entry, _kind in self._disk.entries(layout.MEASUREMENTS):
            if layout.is_temp_name(entry) or not entry.endswith(".json"):
                continue
            if sha is None or layout.measurement_sha(entry) == sha:
                with contextlib.suppress(LegacyRecordError):  # history, bound to no build
                    out.append(self.load_measurement(entry))
        return sorted(out, key=lambda m: m.at)

    def load_measurement(self, filename: str) -> Measurement:
        """A record by file name in `measurements/`. Raises: IntegrityError (module invariants)."""
        from prefixreg.core.records import Measurement

        rel = f"{layout.MEASUREMENTS}/{filename}"
        record = self._disk.record(rel, Measurement.from_dict)
        if layout.measurement_sha(filename) != record.sha256:
            path = self._disk.path(rel)
            raise errors.CorruptRecordError(f"{path}: records sha {record.sha256}", path=path)
        return record

    def receipts(self) -> Iterator[tuple[Path, bytes | None]]:
        """Every receipt file, newest first, with its bytes (None: unreadable)."""
        for entry, kind in reversed(self._disk.entries(layout.PROBES)):
            if kind == "file" and not layout.is_temp_name(entry) and entry.endswith(".json"):
                rel = f"{layout.PROBES}/{entry}"
                try:
                    raw: bytes | None = self._disk.read(rel)
                except (OSError, errors.PrefixregError):
                    raw = None
                yield self._disk.path(rel), raw

    def receipt_refs(self) -> tuple[set[str], bool]:
        """(every sha the receipts' calls name, whether some receipt could not be read or
        parsed: a caller deciding what to delete must then keep every probe slice)."""
        found = [None if raw is None else receipt_shas(raw) for _path, raw in self.receipts()]
        return set().union(*(shas for shas in found if shas is not None)), None in found


def receipt_shas(raw: bytes) -> set[str] | None:
    """The shas a probe receipt's calls name, or None when it does not parse."""
    try:
        calls = loads_object(raw).get("calls")
    except errors.CorruptRecordError:
        return None
    if not isinstance(calls, list):
        return None
    shas = (call.get("sha256") if isinstance(call, dict) else None for call in calls)
    return {sha for sha in shas if isinstance(sha, str) and is_full_sha(sha)}

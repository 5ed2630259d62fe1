"""What a mirror run reports: one `DestinationResult` per destination, one `MirrorReport`.

Role: plain records, no I/O. Invariants: `result` is one of ok, failed, refused, dry-run;
`ok` is True only for ok and dry-run; `content` is the judge's copy verdict
(`core.judge.judge_copy`) and `verified` is only ever read from it; `log_record` is the
`mirror.log` line of a destination (no changes: one short line per run and destination).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Final

from prefixreg.core.judge import CopyVerdict
from prefixreg.registry.store import iso_utc, utc_now
from prefixreg.verbs.mirror.rsync import Change

_UNLOGGED: Final = {"log": False}


@dataclass(slots=True)
class PassRecord:
    """One rsync step of a run, with what it did (kept for the ordering tests and --debug)."""

    kind: str
    changes: list[Change]


@dataclass(slots=True)
class DestinationResult:
    """What happened at one destination.

    `hashed`: objects hashed at the destination that matched their names (the sweep of
    what was there, the read-back of what was sent); `changed_in_place`: objects there
    whose bytes did not (sent again); `read_back`: objects sent, then hashed there.
    """

    destination: str
    result: str = "failed"
    sent: int = 0
    deleted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    content: CopyVerdict = "unchecked"
    hashed: int = 0
    changed_in_place: int = 0
    rounds: int = 0
    read_back: int = 0
    # Not in the log line's fields (the error is added when there is one):
    new: bool = field(default=False, metadata=_UNLOGGED)
    error: str | None = field(default=None, metadata=_UNLOGGED)
    changes: list[Change] = field(default_factory=list, metadata=_UNLOGGED)
    passes: list[PassRecord] = field(default_factory=list, metadata=_UNLOGGED)

    @property
    def ok(self) -> bool:
        return self.result in ("ok", "dry-run")

    @property
    def verified(self) -> bool:
        return self.content == "verified"

    def _fields(self) -> dict[str, object]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata != _UNLOGGED}
        return {**out, "seconds": round(self.seconds, 3), "verified": self.verified}

    def log_record(self, objects_verified: int) -> dict[str, object]:
        record = {"at": iso_utc(utc_now()), **self._fields(), "objects_verified": objects_verified}
        return record if self.error is None else {**record, "error": self.error}

    def to_dict(self) -> dict[str, object]:
        """The `--json` form: the log fields, whether it was new, the error, what changed."""
        extra = {"ok": self.ok, "new": self.new, "error": self.error}
        return {**self._fields(), **extra, "changes": [str(c) for c in self.changes]}


@dataclass(slots=True)
class MirrorReport:
    """The whole run: `objects_verified` counts source objects re-hashed before sending."""

    source: str
    dry_run: bool
    full_verify: bool
    objects_verified: int = 0
    results: list[DestinationResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r.destination for r in self.results if not r.ok]

    def to_dict(self) -> dict[str, object]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "results"}
        results = [r.to_dict() for r in self.results]
        return {**out, "ok": self.ok, "failed": self.failed, "destinations": results}

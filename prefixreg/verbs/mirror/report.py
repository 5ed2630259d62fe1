"""What a mirror run reports: one `DestinationResult` per destination, one `MirrorReport`.

Role: plain records, no I/O. Invariants: `result` is one of ok, failed, refused, dry-run;
`ok` is True only for ok and dry-run; `log_record` is exactly the `mirror.log` line of a
destination (no changes list: the log stays one short line per run and destination).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixreg.registry.store import iso_utc, utc_now
from prefixreg.verbs.mirror.rsync import Change

__all__ = ["DestinationResult", "MirrorReport", "PassRecord"]


@dataclass(slots=True)
class PassRecord:
    """One rsync step of a run, with what it did (kept for the ordering tests and --debug)."""

    kind: str
    changes: list[Change]


@dataclass(slots=True)
class DestinationResult:
    """What happened at one destination; `result` is ok, failed, refused or dry-run."""

    destination: str
    result: str = "failed"
    sent: int = 0
    deleted: int = 0
    bytes: int = 0
    seconds: float = 0.0
    verified: bool = False
    checksum: bool = False
    rounds: int = 0
    new: bool = False
    read_back: int = 0
    error: str | None = None
    changes: list[Change] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.result in ("ok", "dry-run")

    def _fields(self) -> dict[str, object]:
        return {
            "destination": self.destination,
            "result": self.result,
            "sent": self.sent,
            "deleted": self.deleted,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "verified": self.verified,
            "checksum": self.checksum,
            "rounds": self.rounds,
            "read_back": self.read_back,
        }

    def log_record(self, objects_verified: int) -> dict[str, object]:
        """The `mirror.log` line for this destination."""
        record = {"at": iso_utc(utc_now()), **self._fields(), "objects_verified": objects_verified}
        if self.error is not None:
            record["error"] = self.error
        return record

    def to_dict(self) -> dict[str, object]:
        """The `--json` form: the log fields plus whether it was new and what changed."""
        return {
            **self._fields(),
            "ok": self.ok,
            "new": self.new,
            "error": self.error,
            "changes": [str(c) for c in self.changes],
        }


@dataclass(slots=True)
class MirrorReport:
    """The whole run: `objects_verified` counts objects re-hashed before sending."""

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
        return {
            "source": self.source,
            "ok": self.ok,
            "dry_run": self.dry_run,
            "full_verify": self.full_verify,
            "objects_verified": self.objects_verified,
            "failed": self.failed,
            "destinations": [r.to_dict() for r in self.results],
        }

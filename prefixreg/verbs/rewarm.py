"""What a keeper did: one `Rewarm` per re-warm call, and the run's `KeepAliveSummary`.

Invariants:
- Counts come from verified evidence only: a missing cached count is never taken as zero,
  and an unverified re-warm is counted as such, never as resumed or cold.
- A re-warm *succeeded* when the call completed with verified counts (whatever its verdict:
  a first warm is cold by nature); a run in which none succeeded proved nothing, and the
  CLI exits non-zero for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixreg.core.jsonio import JSONObject
from prefixreg.verbs.budget import Unit
from prefixreg.verbs.measure import CallRecord, Verdict

__all__ = ["KeepAliveSummary", "Rewarm"]


@dataclass(frozen=True, slots=True)
class Rewarm:
    """One re-warm: which prefix, how much foreign activity since its last use (in the
    budget's unit; None for a first warm), and what the server said. A kept frame's re-warm
    names its system prefix in `sha256` and the frame in `frame`."""

    sha256: str
    since: float | None
    verdict: Verdict
    record: CallRecord
    budget: float
    unit: Unit
    frame: str | None = None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "frame": self.frame,
            f"since_{self.unit}": self.since,
            "verdict": self.verdict,
            f"budget_{self.unit}": self.budget,
            **self.record.to_dict(),
        }


@dataclass(slots=True)
class KeepAliveSummary:
    """What a keeper did: re-warms by outcome, tokens spent and kept warm, polls, errors."""

    rewarms: int = 0
    resumed: int = 0
    partial: int = 0
    cold: int = 0
    unverified: int = 0
    tokens_spent: int = 0
    tokens_saved: int = 0
    polls: int = 0
    skipped_polls: int = 0
    errors: int = 0
    budget_changes: list[str] = field(default_factory=list)
    stopped_because: str | None = None
    stopped_by_worker: bool = False

    @property
    def succeeded(self) -> int:
        """Re-warms that completed with verified counts (resumed, partial or cold)."""
        return self.resumed + self.partial + self.cold

    def to_dict(self) -> JSONObject:
        return {
            "rewarms": self.rewarms,
            "succeeded": self.succeeded,
            "resumed": self.resumed,
            "partial": self.partial,
            "cold": self.cold,
            "unverified": self.unverified,
            "tokens_spent": self.tokens_spent,
            "tokens_saved": self.tokens_saved,
            "polls": self.polls,
            "skipped_polls": self.skipped_polls,
            "errors": self.errors,
            "budget_changes": list(self.budget_changes),
            "stopped_because": self.stopped_because,
            "stopped_by_worker": self.stopped_by_worker,
        }

    def __str__(self) -> str:
        return (
            f"{self.rewarms} re-warms ({self.resumed} resumed, {self.partial} partial, "
            f"{self.cold} cold, "
            f"{self.unverified} unverified); {self.tokens_spent:,} tokens spent, "
            f"{self.tokens_saved:,} prefix tokens kept warm; {self.polls} polls "
            f"({self.skipped_polls} skipped), {self.errors} errors"
        )

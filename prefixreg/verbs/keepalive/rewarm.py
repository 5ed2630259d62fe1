"""What a keeper did: one `Rewarm` per re-warm call, and the run's `KeepAliveSummary`.

Invariants:
- Counts come from verified evidence only: a missing cached count is never taken as zero,
  and an unverified re-warm is counted as such, never as resumed or cold.
- A re-warm *succeeded* when the call completed with verified counts (whatever its verdict:
  a first warm is cold by nature); a run in which none succeeded proved nothing, and the
  CLI exits non-zero for it.
- A re-warm done by restoring a snapshot (llama.cpp, after a restart) carries its
  `snapshot` report; the summary adds up each way's cost: the restores' seconds against
  the prefix tokens they did not prefill and the measured cold seconds of those prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Verdict
from prefixreg.verbs.measure.budget import Unit
from prefixreg.verbs.measure.calls import CallRecord

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
    snapshot: JSONObject | None = None  # the restore attempt, when one was made

    def to_dict(self) -> JSONObject:
        out: JSONObject = {
            "sha256": self.sha256,
            "frame": self.frame,
            f"since_{self.unit}": self.since,
            "verdict": self.verdict,
            f"budget_{self.unit}": self.budget,
            **self.record.to_dict(),
        }
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot
        return out

    def measurement_body(self, budget: JSONObject) -> JSONObject:
        """The body of this re-warm's `keepalive` measurement record."""
        ev = self.record.evidence
        body: JSONObject = {
            "verdict": self.verdict,
            f"since_{self.unit}": self.since,
            "budget": budget,
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "snapshot": self.snapshot,
            "calls": [self.record.to_dict()],
        }
        if self.frame is not None:
            body["frame"] = self.frame
        return body


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
    restored: int = 0  # re-warms done by a proven snapshot restore
    restore_misses: int = 0  # restores tried that were not proven (then re-warmed)
    restore_s: float = 0.0  # their server restore time plus check wall time
    prefill_tokens_avoided: int = 0  # the prefix tokens those restores did not prefill
    prefill_s_avoided: float = 0.0  # the measured cold seconds of those prefixes (if known)

    def count(self, rewarm: Rewarm) -> None:
        """Add one re-warm to the totals (verified counts only: a missing cached count is
        never taken as zero)."""
        ev = rewarm.record.evidence
        self.rewarms += 1
        if ev.cache_state == "unverified":
            self.unverified += 1
        elif rewarm.verdict == "resumed":
            self.resumed += 1
            self.tokens_saved += ev.cached_tokens or 0
        elif rewarm.verdict == "partial":
            self.partial += 1
        else:
            self.cold += 1
        if ev.cache_state != "unverified" and ev.prompt_tokens is not None:
            self.tokens_spent += ev.prompt_tokens - (ev.cached_tokens or 0)
            self.tokens_spent += ev.completion_tokens or 0

    def saw_restore(
        self,
        restored: bool,
        restore_s: float | None,
        prefill_tokens: int | None,
        prefill_s: float | None,
    ) -> None:
        """Count one restore attempt (a miss is re-warmed normally, and counted as such)."""
        if not restored:
            self.restore_misses += 1
            return
        self.restored += 1
        self.restore_s += restore_s or 0.0
        self.prefill_tokens_avoided += prefill_tokens or 0
        self.prefill_s_avoided += prefill_s or 0.0

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
            "snapshots": {
                "restored": self.restored,
                "misses": self.restore_misses,
                "restore_s": round(self.restore_s, 6),
                "prefill_tokens_avoided": self.prefill_tokens_avoided,
                "prefill_s_avoided": round(self.prefill_s_avoided, 6),
            },
        }

    def __str__(self) -> str:
        return (
            f"{self.rewarms} re-warms ({self.resumed} resumed, {self.partial} partial, "
            f"{self.cold} cold, "
            f"{self.unverified} unverified); {self.tokens_spent:,} tokens spent, "
            f"{self.tokens_saved:,} prefix tokens kept warm; {self.polls} polls "
            f"({self.skipped_polls} skipped), {self.errors} errors"
            + (
                f"; {self.restored} restored from snapshots in {self.restore_s:.3f} s "
                f"instead of prefilling {self.prefill_tokens_avoided:,} tokens "
                f"(measured cold: {self.prefill_s_avoided:.3f} s)"
                if self.restored
                else ""
            )
            + (f"; {self.restore_misses} restores not proven" if self.restore_misses else "")
        )

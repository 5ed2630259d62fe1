"""What a keeper did: one `Rewarm` per re-warm call, and the run's `KeepAliveSummary`.

Invariants:
- A re-warm's verdict is the judge's; it is *kept* only when the judge says resumed. A
  partial re-warm (a few cached tokens of a long head) is not kept and is counted as
  partial, never as resumed or cold; an unverified one is counted as such.
- A re-warm *succeeded* when the judge could read its counts (resumed, partial or cold: a
  first warm is cold by nature); a run in which none succeeded proved nothing, and the CLI
  exits non-zero for it. Tokens are added up from verified counts only.
- A re-warm done by restoring a snapshot carries its `snapshot` report; the summary sets
  the restores' seconds against the head tokens they did not prefill and the measured cold
  seconds of those heads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Verdict
from prefixreg.verbs.measure.budget import Unit
from prefixreg.verbs.measure.calls import CallRecord


@dataclass(frozen=True, slots=True)
class Rewarm:
    """One re-warm: which head (a frame's names its system prefix in `sha256`, the frame in
    `frame`), the foreign activity since its last use (the budget's unit; None for a first
    warm), and the judge's verdict on the call."""

    sha256: str
    since: float | None
    verdict: Verdict
    record: CallRecord
    budget: float
    unit: Unit
    frame: str | None = None
    snapshot: JSONObject | None = None  # the restore attempt, when one was made

    def to_dict(self) -> JSONObject:
        out: JSONObject = {"sha256": self.sha256, "frame": self.frame, "verdict": self.verdict}
        out[f"since_{self.unit}"], out[f"budget_{self.unit}"] = self.since, self.budget
        out.update(self.record.to_dict())
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot
        return out

    def measurement_body(self, budget: JSONObject) -> JSONObject:
        """The body of this re-warm's `keepalive` measurement record."""
        ev = self.record.evidence
        body: JSONObject = {"verdict": self.verdict, f"since_{self.unit}": self.since}
        body["prompt_tokens"], body["cached_tokens"] = ev.prompt_tokens, ev.cached_tokens
        body["budget"], body["snapshot"] = budget, self.snapshot
        body["calls"] = [self.record.to_dict()]
        if self.frame is not None:
            body["frame"] = self.frame
        return body


@dataclass(slots=True)
class KeepAliveSummary:
    """What a keeper did: re-warms by verdict, tokens spent and kept warm, polls, errors."""

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
    prefill_tokens_avoided: int = 0  # the head tokens those restores did not prefill
    prefill_s_avoided: float = 0.0  # the measured cold seconds of those heads (if known)

    def count(self, rewarm: Rewarm) -> None:
        """Add one re-warm by the judge's verdict (a missing count is never zero)."""
        ev, verdict = rewarm.record.evidence, rewarm.verdict
        self.rewarms += 1
        if verdict == "resumed":
            self.resumed += 1
            self.tokens_saved += ev.cached_tokens or 0
        elif verdict == "partial":
            self.partial += 1
        elif verdict == "cold":
            self.cold += 1
        else:
            self.unverified += 1
        if verdict != "unverified" and ev.prompt_tokens is not None:
            self.tokens_spent += ev.prompt_tokens - (ev.cached_tokens or 0)
            self.tokens_spent += ev.completion_tokens or 0

    def saw_restore(
        self, restored: bool, restore_s: float | None, tokens: int | None, cold_s: float | None
    ) -> None:
        """Count one restore attempt (a miss is re-warmed normally, and counted as such)."""
        if not restored:
            self.restore_misses += 1
            return
        self.restored += 1
        self.restore_s += restore_s or 0.0
        self.prefill_tokens_avoided += tokens or 0
        self.prefill_s_avoided += cold_s or 0.0

    @property
    def kept(self) -> int:
        """Re-warms the judge says resumed: the only ones that kept their head warm."""
        return self.resumed

    @property
    def succeeded(self) -> int:
        """Re-warms whose counts the judge could read (resumed, partial or cold)."""
        return self.resumed + self.partial + self.cold

    def to_dict(self) -> JSONObject:
        out: JSONObject = asdict(self)
        restores = ("restored", "restore_misses", "restore_s", "prefill_tokens_avoided")
        snapshots = {k: out.pop(k) for k in (*restores, "prefill_s_avoided")}
        return out | {"kept": self.kept, "succeeded": self.succeeded, "snapshots": snapshots}

    def __str__(self) -> str:
        text = (
            f"{self.rewarms} re-warms: {self.kept} kept (resumed), {self.partial + self.cold} "
            f"not kept ({self.partial} partial, {self.cold} cold), {self.unverified} "
            f"unverified; {self.tokens_spent:,} tokens spent, {self.tokens_saved:,} prefix "
            f"tokens kept warm; {self.polls} polls ({self.skipped_polls} skipped), "
            f"{self.errors} errors"
        )
        if self.restored:
            text += (
                f"; {self.restored} restored from snapshots in {self.restore_s:.3f} s instead "
                f"of prefilling {self.prefill_tokens_avoided:,} tokens (measured cold: "
                f"{self.prefill_s_avoided:.3f} s)"
            )
        if self.restore_misses:
            text += f"; {self.restore_misses} restores not proven"
        return text

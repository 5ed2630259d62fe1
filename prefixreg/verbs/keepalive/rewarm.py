"""What a keeper did (one `Rewarm` per re-warm call, the run's `KeepAliveSummary`), and on
llama.cpp the restore of a head lost to a server restart or eviction (`restore_for_keepalive`).

Invariants:
- A re-warm's verdict is the judge's and it is counted under it (a partial or unverified one
  never as resumed or cold); it is *kept* only when resumed (not a few cached tokens).
- A re-warm *succeeded* when the judge could read its counts (resumed, partial or cold: a
  first warm is cold by nature); a run where none succeeded proved nothing (the CLI exits
  non-zero). Tokens are added up from verified counts only.
- After a restart every slot is empty: a head with a snapshot for the worker's *current*
  build is restored (`measure.slots.restore_head`, never a warm) into a slot no other kept
  head is known to hold, and the pinned check is the re-warm's call. Only `restored`
  replaces the re-warm; anything else (no snapshot for this build, refused, not proven, a
  record or file that does not verify) is reported, then a normal re-warm.
- A restore's cost (server time plus the check's wall time and uncached tokens) is set
  against a re-prefill's (the head's tokens; the newest cold call of it on this build).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields

from prefixreg.core.errors import CorruptRecordError, IntegrityError, WorkerError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Verdict
from prefixreg.core.records import CallEvidence
from prefixreg.registry.snapshots import list_snapshots
from prefixreg.registry.store import Registry
from prefixreg.server.slots import list_slots
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.budget import Unit
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.measure.metrics import Metrics
from prefixreg.verbs.measure.slots import restore_head


@dataclass(frozen=True, slots=True)
class Rewarm:
    """One re-warm: its head (`sha256` the system prefix, `frame` a frame's sha), the foreign
    activity since its last use (the budget's unit; None: a first warm), the judge's verdict."""

    sha256: str
    since: float | None
    verdict: Verdict
    record: CallRecord
    budget: float
    unit: Unit
    frame: str | None = None
    snapshot: JSONObject | None = None  # the restore attempt, when one was made

    def measurement_body(self, budget: JSONObject) -> JSONObject:
        """The body of this re-warm's `keepalive` measurement record."""
        ev = self.record.evidence
        body: JSONObject = {"verdict": self.verdict, f"since_{self.unit}": self.since}
        body |= {"prompt_tokens": ev.prompt_tokens, "cached_tokens": ev.cached_tokens}
        body |= {"budget": budget, "snapshot": self.snapshot, "calls": [self.record.to_dict()]}
        return body if self.frame is None else body | {"frame": self.frame}


@dataclass(frozen=True, slots=True)
class SnapshotRewarm:
    """One attempt to restore a lost head: the verdict, tokens and seconds each way, and
    `check`, the pinned resume check when `restored` (the keeper's re-warm call)."""

    verdict: str
    reason: str
    slot: int | None = None
    restore_s: float | None = None  # the server's restore time plus the check's wall time
    restore_tokens: int | None = None  # tokens the check computed (its uncached part)
    prefill_tokens: int | None = None  # head tokens a re-prefill would have computed
    prefill_s: float | None = None  # the newest cold call of this head on this build
    check: CallRecord | None = None

    def to_dict(self) -> JSONObject:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "check"}


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
    sessions: int = 0  # re-warms that re-touched the loop's session (head and history)
    session_skipped: int = 0  # session lines that sent none of the kept heads
    backoffs: int = 0  # times the cost rule held re-warms back
    left_to_loop: int = 0  # evicted heads not restored: not re-prefilled (the cost rule)
    backoff_reason: str | None = None  # the latest one's reason
    dropped: list[str] = field(default_factory=list)  # sessions dropped, heads given up: why
    first_partial: int = 0  # of the partial re-warms, a head's first warm: none was kept yet
    first_cold: int = 0  # of the cold ones, likewise
    bursts: int = 0  # cold or partial after a burst between polls (`judge_burst`)
    burst_landed: float = 0.0  # the largest such burst, in the budget's unit
    burst_survives: float = 0.0  # what a head survived then, in that unit
    burst_unit: str = ""

    def count(
        self,
        rewarm: Rewarm,
        snap: SnapshotRewarm | None = None,
        *,
        session: bool = False,
        first: bool = False,
    ) -> None:
        """Add one re-warm by the judge's verdict (a missing count is never zero), and the
        restore attempt before it (a miss was re-warmed normally); `first`: the head's first
        warm (cold by nature: nothing was kept yet, so it is never "not kept")."""
        ev, verdict = rewarm.record.evidence, rewarm.verdict
        self.rewarms += 1
        self.first_partial += first and verdict == "partial"
        self.first_cold += first and verdict == "cold"
        self.sessions += session
        setattr(self, verdict, getattr(self, verdict) + 1)  # one counter per verdict
        if verdict == "resumed":
            self.tokens_saved += ev.cached_tokens or 0
        if verdict != "unverified" and ev.prompt_tokens is not None:
            self.tokens_spent += ev.prompt_tokens - (ev.cached_tokens or 0)
            self.tokens_spent += ev.completion_tokens or 0
        if snap is not None and snap.check is None:
            self.restore_misses += 1
        elif snap is not None:
            self.restored += 1
            self.restore_s += snap.restore_s or 0.0
            self.prefill_tokens_avoided += snap.prefill_tokens or 0
            self.prefill_s_avoided += snap.prefill_s or 0.0

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

    def metrics(self, labels: Mapping[str, str] | None = None) -> Metrics:
        """This run's counters (`--metrics-file`), the same numbers as `to_dict`."""
        out, base = Metrics(), dict(labels or {})

        def counter(name: str, value: float, help_text: str, **more: str) -> None:
            out.set(f"prefixreg_{name}_total", value, help_text, base | more, kind="counter")

        for verdict in ("resumed", "partial", "cold", "unverified"):
            what = "Re-warms by the judge's verdict (resumed: the head was kept warm)"
            counter("rewarms", getattr(self, verdict), what, outcome=verdict)
        counter(
            "resumed_tokens", self.tokens_saved, "Cached tokens (head and session) of kept re-warms"
        )
        counter("rewarm_spent_tokens", self.tokens_spent, "Uncached prompt plus output tokens")
        counter("counter_polls", self.polls, "Polls of the server's cache counters")
        counter("counter_polls_skipped", self.skipped_polls, "Polls that could not be read")
        counter("worker_errors", self.errors, "Worker errors met by the keeper")
        for outcome, n in (("restored", self.restored), ("not_proven", self.restore_misses)):
            counter("snapshot_restores", n, "Snapshot restores of lost heads", outcome=outcome)
        counter("snapshot_restore_seconds", self.restore_s, "Seconds the proven restores took")
        avoided = self.prefill_tokens_avoided
        counter("prefill_avoided_tokens", avoided, "Head tokens restores did not prefill")
        seconds = self.prefill_s_avoided
        counter("prefill_avoided_seconds", seconds, "Measured cold seconds restores avoided")
        return out

    def burst(self, landed: float, survives: float, unit: str) -> None:
        """Count a re-warm the judge says a burst between polls defeated (`judge_burst`)."""
        self.bursts += 1
        if landed >= self.burst_landed:
            self.burst_landed, self.burst_survives, self.burst_unit = landed, survives, unit

    def __str__(self) -> str:
        first = self.first_partial + self.first_cold
        partial, cold = self.partial - self.first_partial, self.cold - self.first_cold
        firsts = f"{first} first warm{'s' * (first != 1)} (nothing kept yet), " if first else ""
        text = (
            f"{self.rewarms} re-warms: {firsts}{self.kept} kept (resumed), {partial + cold} "
            f"not kept ({partial} partial, {cold} cold), {self.unverified} "
            f"unverified; {self.tokens_spent:,} tokens spent, {self.tokens_saved:,} cached "
            f"tokens kept warm (heads and sessions); {self.polls} polls "
            f"({self.skipped_polls} skipped), {self.errors} errors"
        )
        restored = (
            f"{self.restored} restored from snapshots in {self.restore_s:.3f} s instead of "
            f"prefilling {self.prefill_tokens_avoided:,} tokens (measured cold: "
            f"{self.prefill_s_avoided:.3f} s)"
        )
        left = "evicted heads left to the loop (a re-prefill would spend what it saves)"
        burst = (
            f"{self.bursts} not kept after a burst of foreign prompts between polls (up to "
            f"{self.burst_landed:g} {self.burst_unit} landed between two polls; a head survives "
            f"{self.burst_survives:g}): polling sooner cannot help, only more cache entries"
        )
        parts = [
            (self.restored, restored),
            (self.restore_misses, f"{self.restore_misses} restores not proven"),
            (self.sessions, f"{self.sessions} re-touched the loop's session"),
            (self.session_skipped, f"{self.session_skipped} session lines sent no kept head"),
            (self.left_to_loop, f"{self.left_to_loop} {left}"),
            (self.bursts, burst),
            (self.backoffs, f"backed off {self.backoffs} times ({self.backoff_reason})"),
            *((1, note) for note in self.dropped),
        ]
        return "; ".join([text, *(part for count, part in parts if count)])


def _free_slot(worker: Worker, taken: Collection[int]) -> int | None:
    """The first idle slot not `taken` by another kept head (None: let the server pick)."""
    try:
        return next((s.id for s in list_slots(worker) if s.idle and s.id not in taken), None)
    except WorkerError:
        return None


def _last_cold_s(registry: Registry, sha: str, build_id: str) -> float | None:
    """Wall seconds of the newest cold call of `sha` measured on `build_id`, or None."""
    for m in reversed(registry.measurements(sha)):
        calls = m.body.get("calls") if m.build.build_id == build_id else None
        for call in calls if isinstance(calls, list) else []:
            try:
                ev = CallEvidence.from_dict(call.get("evidence") if isinstance(call, dict) else 0)
            except CorruptRecordError:
                continue
            if ev.cache_state == "cold" and ev.wall_s is not None:
                return ev.wall_s
    return None


def restore_for_keepalive(
    registry: Registry, worker: Worker, head: Head, *, taken: Collection[int] = ()
) -> SnapshotRewarm | None:
    """Restore `head`'s snapshot for the worker's current build and prove it; never warms.
    None, and no request sent, when the head has no snapshot record. Raises WorkerError: the
    worker failed outside the restore requests (the keeper's error path)."""
    try:
        if not list_snapshots(registry, head.sha256):
            return None
        result = restore_head(registry, worker, head, slot=_free_slot(worker, taken))
    except IntegrityError as exc:  # a record or file that does not verify: nothing was sent
        return SnapshotRewarm("integrity", str(exc))
    ev, t = None if result.check is None else result.check.evidence, result.transfer
    restore_s = uncached = None
    if t is not None and t.server_ms is not None and ev is not None and ev.wall_s is not None:
        restore_s = t.server_ms / 1000 + ev.wall_s
    if ev is not None and ev.prompt_tokens is not None and ev.cached_tokens is not None:
        uncached = ev.prompt_tokens - ev.cached_tokens
    return SnapshotRewarm(
        result.verdict,
        result.reason,
        slot=None if t is None else t.slot_id,
        restore_s=restore_s,
        restore_tokens=uncached,
        prefill_tokens=None if ev is None else ev.cached_tokens,
        prefill_s=_last_cold_s(registry, head.system.sha256, result.build.build_id),
        check=result.check if result.verdict == "restored" else None,
    )

"""A probe's calls (`ProbeCall`) and the six `/cache` counter checks over them. Pure.

Each call has a window: the `/cache` snapshots just before and just after it. A check
compares what the counters moved in a window with what the call's own evidence says. Halogen
Flash was measured to publish `prompt_tokens_saved`, `hits` and `misses` one call late, so a
check that fails per call is tried again with attribution shifted by one or two windows
("windowed"); passing only then means "the counters are right, but land L calls late".
A window whose `hits + misses` moved by more than one call is *interleaved* (foreign traffic);
no lagged check counts it or its neighbours, since a lagged count is published by whichever
request starts next and can trade places with a foreign one across adjacent windows. A check
with nothing to compare is `n/a`, never a pass; check 5 is information, never a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Judgement, Verdict
from prefixreg.server.counters import counter_deltas
from prefixreg.verbs.measure.calls import CallRecord

Status = Literal["pass", "fail", "n/a", "info"]
Expect = Callable[["ProbeCall"], dict[str, int] | None]
TITLES: Final = {
    1: "prompt_tokens_saved delta across A2 equals its cached_tokens",
    2: "hits +1 / misses +0 across A2 and B, misses +1 across A1",
    3: "stores delta equals evicted delta once the cache is full",
    4: "entries stays at max_entries once full",
    5: "last_entry_bytes after the smallest vs the largest store",
    6: "refused stays 0",
}


@dataclass(frozen=True, slots=True)
class ProbeCall:
    """One call the probe made: its leg and size, what was sent (by hash), what was seen, and
    the judge's verdict on it (None for foreign prompts, which are not judged)."""

    leg: str
    size: int | None
    sha256: str
    record: CallRecord
    judgement: Judgement | None = None

    @property
    def verdict(self) -> Verdict | None:
        return None if self.judgement is None else self.judgement.verdict

    @property
    def interleaved(self) -> bool:
        return self.record.interleaved is True

    def delta(self, name: str) -> int | None:
        """What counter `name` moved in this call's window (None: no snapshots)."""
        before, after = self.record.before, self.record.after
        return None if before is None or after is None else counter_deltas(before, after)[name]

    def __str__(self) -> str:
        return f"{self.leg}@{self.size}"

    def to_dict(self) -> JSONObject:
        judged = {"verdict": None} if self.judgement is None else self.judgement.to_dict()
        head = {"leg": self.leg, "size": self.size, "sha256": self.sha256}
        return {**head, **judged, **self.record.to_dict()}


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check: per-call status, windowed status (with the lag found), and the numbers."""

    number: int
    title: str
    per_call: Status
    windowed: Status
    lag: int | None
    detail: str

    @property
    def failed(self) -> bool:
        """Failed beyond the lag explanation."""
        return self.per_call == "fail" and self.windowed != "pass"


def _result(number: int, status: Status, detail: str, lag: int | None = None) -> CheckResult:
    return CheckResult(number, TITLES[number], status, status, lag, detail)


def _attributed(
    calls: Sequence[ProbeCall], targets: Sequence[int], expect: Expect, lag: int
) -> tuple[int, list[str]]:
    """(calls compared, mismatches) with each target's expectation credited to the window
    `lag` calls after it. Interleaved windows and unverified calls are left out, not passed."""
    compared, notes = 0, []
    for i in targets:
        j = i + lag
        want = expect(calls[i]) if j < len(calls) else None
        # Lagged counters publish when the *next* request starts, whoever sends it: a window
        # only counts when none from just before the target to just after it is interleaved.
        if want is None or calls[j].record.before is None:
            continue
        if any(c.interleaved for c in calls[max(0, i - 1) : j + 2]):
            continue
        compared += 1
        for name, value in want.items():
            if (got := calls[j].delta(name)) != value:
                notes.append(f"{calls[i]}: {name} {got} != {value}")
    return compared, notes


def _lagged_check(
    number: int, calls: Sequence[ProbeCall], targets: Sequence[int], expect: Expect
) -> CheckResult:
    compared, notes = _attributed(calls, targets, expect, 0)
    if compared and not notes:
        return _result(number, "pass", f"{compared} calls, per call", 0)
    for lag in (1, 2):
        n_lag, lag_notes = _attributed(calls, targets, expect, lag)
        if n_lag and not lag_notes:
            late = "one call" if lag == 1 else f"{lag} calls"
            before = f"per call: {'; '.join(notes[:3])}. " if notes else ""
            detail = f"{before}Over windows: {n_lag} calls match when the counters land {late} "
            detail += f"late (counter lag {lag})."
            per_call: Status = "fail" if compared else "n/a"
            return CheckResult(number, TITLES[number], per_call, "pass", lag, detail)
    if not compared:
        return _result(number, "n/a", "no window to compare")
    return _result(number, "fail", "; ".join(notes[:4]))


def _saved(c: ProbeCall) -> dict[str, int] | None:
    ev = c.record.evidence
    unknown = ev.cache_state == "unverified" or ev.cached_tokens is None
    return None if unknown else {"prompt_tokens_saved": ev.cached_tokens or 0}


def _hit_miss(c: ProbeCall) -> dict[str, int] | None:
    state = c.record.evidence.cache_state
    hit = state == "reused"
    return None if state == "unverified" else {"hits": int(hit), "misses": int(not hit)}


def _check_full(calls: Sequence[ProbeCall]) -> list[CheckResult]:
    """Checks 3 and 4, from the first call that starts with the cache full."""
    starts = [c.record.before for c in calls]
    is_full = [
        b is not None and b.entries is not None and b.entries == b.max_entries for b in starts
    ]
    if True not in is_full:
        return [_result(n, "n/a", "the cache never reported itself full") for n in (3, 4)]
    full = is_full.index(True)
    moved = [(c, c.delta("stores"), c.delta("evicted")) for c in calls[full:]]
    counted = [(c, s, e) for c, s, e in moved if not c.interleaved and None not in (s, e)]
    bad = [f"{c}: stores +{s}, evicted +{e}" for c, s, e in counted if s != e]
    status: Status = "fail" if bad else ("pass" if counted else "n/a")
    off = [
        f"{c}: entries {a.entries} of {a.max_entries}"
        for c in calls[full:]
        if (a := c.record.after) is not None and a.entries != a.max_entries
    ]
    held = f"{getattr(starts[full], 'max_entries', None)} entries"
    return [
        _result(3, status, "; ".join(bad[:4]) or f"{len(counted)} calls"),
        _result(4, "fail" if off else "pass", "; ".join(off[:4]) or held),
    ]


def _check_entry_bytes(calls: Sequence[ProbeCall], sizes: Sequence[int]) -> CheckResult:
    if len(set(sizes)) < 2:
        return _result(5, "n/a", "needs two sizes to compare")
    firsts = {c.size: (c, a) for c in calls if c.leg == "A1" and (a := c.record.after)}
    if min(sizes) not in firsts or max(sizes) not in firsts:
        return _result(5, "n/a", "no /cache snapshots around A1")
    (small, after_small), (large, after_large) = firsts[min(sizes)], firsts[max(sizes)]
    b_small, b_large = after_small.last_entry_bytes, after_large.last_entry_bytes
    if b_small is None or b_large is None:
        return _result(5, "n/a", "/cache reports no last_entry_bytes")
    if b_small == b_large:
        detail = f"{b_small:,} bytes after both: a fixed entry size, so only cached_tokens can"
        return _result(5, "info", detail + " answer capacity")
    detail = f"{b_small:,} -> {b_large:,} bytes: entries grow with the prompt"
    p_small, p_large = small.record.evidence.prompt_tokens, large.record.evidence.prompt_tokens
    if p_small is not None and p_large is not None and p_large != p_small:
        detail += f", about {(b_large - b_small) / (p_large - p_small):,.0f} bytes per position"
    return _result(5, "info", detail)


def _check_refused(calls: Sequence[ProbeCall]) -> CheckResult:
    moved = [(c, r) for c in calls if (r := c.delta("refused")) is not None]
    if not moved:
        return _result(6, "n/a", "/cache reports no refused counter")
    bad = [
        f"+{r} on {c} ({c.record.evidence.prompt_tokens} prompt tokens): the budget is too small"
        for c, r in moved
        if r
    ]
    return _result(6, "fail" if bad else "pass", "; ".join(bad[:4]) or f"{len(moved)} calls")


def run_checks(calls: Sequence[ProbeCall], sizes: Sequence[int]) -> list[CheckResult]:
    """The six checks (`TITLES`) over a probe's calls, in the order they were made."""
    if not any(c.record.before is not None for c in calls):
        return [_result(n, "n/a", "the server has no /cache counters") for n in TITLES]
    a2 = [i for i, c in enumerate(calls) if c.leg == "A2"]
    legs = [i for i, c in enumerate(calls) if c.leg in ("A1", "A2", "B")]
    return [
        _lagged_check(1, calls, a2, _saved),
        _lagged_check(2, calls, legs, _hit_miss),
        *_check_full(calls),
        _check_entry_bytes(calls, sizes),
        _check_refused(calls),
    ]

"""The six `/cache` counter checks of a probe, per call and over lagged windows. Pure.

Each probe call has a window: the `/cache` snapshots just before and just after it. A check
compares what the counters moved in a window with what the call's own evidence says. Halogen
Flash was measured to publish `prompt_tokens_saved`, `hits` and `misses` one call late, so a
check that fails per call is tried again with attribution shifted by one or two windows
("windowed"); passing only then means "the counters are right, but land L calls late".
A window whose `hits + misses` moved by more than one call is *interleaved* (foreign traffic);
no lagged check counts it or its neighbours, since a lagged count is published by whichever
request starts next and can trade places with a foreign one across adjacent windows.

Checks (a check with nothing to compare is `n/a`, never a pass):
1. `prompt_tokens_saved` delta across A2 equals A2's `cached_tokens`;
2. hits +1 / misses +0 across A2 and B, misses +1 across A1 (from each call's evidence);
3. `stores` delta equals `evicted` delta on every call once the cache is full;
4. `entries` stays at `max_entries` once full;
5. `last_entry_bytes` after the smallest vs the largest store (information, never a failure);
6. `refused` stays 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.records import CacheCounters, CallEvidence
from prefixreg.server.evidence import counter_deltas, is_interleaved

Status = Literal["pass", "fail", "n/a", "info"]
LAGS: Final = (1, 2)
TITLES: Final = {
    1: "prompt_tokens_saved delta across A2 equals its cached_tokens",
    2: "hits +1 / misses +0 across A2 and B, misses +1 across A1",
    3: "stores delta equals evicted delta once the cache is full",
    4: "entries stays at max_entries once full",
    5: "last_entry_bytes after the smallest vs the largest store",
    6: "refused stays 0",
}


@dataclass(frozen=True, slots=True)
class Window:
    """One call as the checks see it."""

    leg: str
    size: int | None
    evidence: CallEvidence
    before: CacheCounters | None
    after: CacheCounters | None

    @property
    def interleaved(self) -> bool:
        if self.before is None or self.after is None:
            return False
        return is_interleaved(self.before, self.after, 1)

    def delta(self, name: str) -> int | None:
        if self.before is None or self.after is None:
            return None
        return counter_deltas(self.before, self.after)[name]

    def __str__(self) -> str:
        return f"{self.leg}@{self.size}"


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


Expect = Callable[[Window], dict[str, int] | None]


def _attributed(
    windows: Sequence[Window], targets: Sequence[int], expect: Expect, lag: int
) -> tuple[int, list[str]]:
    """(number compared, mismatch notes) when each target's expectation is credited to the
    window `lag` calls after it. Interleaved windows and calls without verified evidence are
    left out, not counted as passes."""
    compared, notes = 0, []
    for i in targets:
        j = i + lag
        if j >= len(windows):
            continue
        want, win = expect(windows[i]), windows[j]
        # Lagged counters publish when the *next* request starts, whoever sends it, so a
        # foreign call can swap places with ours across adjacent windows: a window only
        # counts when no window from just before the target to just after the credited one
        # shows foreign traffic.
        if want is None or win.before is None:
            continue
        if any(w.interleaved for w in windows[max(0, i - 1) : j + 2]):
            continue
        compared += 1
        for name, value in want.items():
            if (got := win.delta(name)) != value:
                notes.append(f"{windows[i]}: {name} {got} != {value}")
    return compared, notes


def _lagged_check(
    number: int, windows: Sequence[Window], targets: Sequence[int], expect: Expect
) -> CheckResult:
    compared, notes = _attributed(windows, targets, expect, 0)
    if compared and not notes:
        return _result(number, "pass", f"{compared} calls, per call", 0)
    for lag in LAGS:
        n_lag, lag_notes = _attributed(windows, targets, expect, lag)
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


def _saved(w: Window) -> dict[str, int] | None:
    cached = w.evidence.cached_tokens
    if w.evidence.cache_state == "unverified" or cached is None:
        return None
    return {"prompt_tokens_saved": cached}


def _hit_miss(w: Window) -> dict[str, int] | None:
    if w.evidence.cache_state == "unverified":
        return None
    hit = w.evidence.cache_state == "reused"
    return {"hits": int(hit), "misses": int(not hit)}


def _check_full(windows: Sequence[Window]) -> list[CheckResult]:
    """Checks 3 and 4, from the first call that starts with the cache full."""
    full = next(
        (
            i
            for i, w in enumerate(windows)
            if w.before is not None and w.before.entries is not None
            if w.before.entries == w.before.max_entries
        ),
        None,
    )
    if full is None:
        return [_result(n, "n/a", "the cache never reported itself full") for n in (3, 4)]
    bad, n = [], 0
    for w in windows[full:]:
        s, e = w.delta("stores"), w.delta("evicted")
        if w.interleaved or s is None or e is None:
            continue
        n += 1
        if s != e:
            bad.append(f"{w}: stores +{s}, evicted +{e}")
    status: Status = "fail" if bad else ("pass" if n else "n/a")
    stores = _result(3, status, "; ".join(bad[:4]) or f"{n} calls")
    off = [
        f"{w}: entries {w.after.entries} of {w.after.max_entries}"
        for w in windows[full:]
        if w.after is not None and w.after.entries != w.after.max_entries
    ]
    first = windows[full].before
    held = f"{None if first is None else first.max_entries} entries"
    entries = _result(4, "fail" if off else "pass", "; ".join(off[:4]) or held)
    return [stores, entries]


def _check_entry_bytes(windows: Sequence[Window], sizes: Sequence[int]) -> CheckResult:
    if len(set(sizes)) < 2:
        return _result(5, "n/a", "needs two sizes to compare")
    firsts = {w.size: w for w in windows if w.leg == "A1" and w.after is not None}
    small, large = firsts.get(min(sizes)), firsts.get(max(sizes))
    if small is None or large is None or small.after is None or large.after is None:
        return _result(5, "n/a", "no /cache snapshots around A1")
    b_small, b_large = small.after.last_entry_bytes, large.after.last_entry_bytes
    if b_small is None or b_large is None:
        return _result(5, "n/a", "/cache reports no last_entry_bytes")
    if b_small == b_large:
        return _result(
            5,
            "info",
            f"{b_small:,} bytes after both: a fixed entry size, so only cached_tokens can "
            "answer capacity",
        )
    detail = f"{b_small:,} -> {b_large:,} bytes: entries grow with the prompt"
    p_small, p_large = small.evidence.prompt_tokens, large.evidence.prompt_tokens
    if p_small is not None and p_large is not None and p_large != p_small:
        detail += f", about {(b_large - b_small) / (p_large - p_small):,.0f} bytes per position"
    return _result(5, "info", detail)


def _check_refused(windows: Sequence[Window]) -> CheckResult:
    moved = [(w, r) for w in windows if (r := w.delta("refused")) is not None]
    if not moved:
        return _result(6, "n/a", "/cache reports no refused counter")
    bad = [
        f"+{r} on {w} ({w.evidence.prompt_tokens} prompt tokens): the budget is too small"
        for w, r in moved
        if r
    ]
    return _result(6, "fail" if bad else "pass", "; ".join(bad[:4]) or f"{len(moved)} calls")


def run_checks(windows: Sequence[Window], sizes: Sequence[int]) -> list[CheckResult]:
    """All six checks over the probe's calls, in the order they were made."""
    if not any(w.before is not None for w in windows):
        return [_result(n, "n/a", "the server has no /cache counters") for n in TITLES]
    a2 = [i for i, w in enumerate(windows) if w.leg == "A2"]
    legs = [i for i, w in enumerate(windows) if w.leg in ("A1", "A2", "B")]
    return [
        _lagged_check(1, windows, a2, _saved),
        _lagged_check(2, windows, legs, _hit_miss),
        *_check_full(windows),
        _check_entry_bytes(windows, sizes),
        _check_refused(windows),
    ]

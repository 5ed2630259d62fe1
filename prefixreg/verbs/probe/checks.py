"""The six `/cache` counter checks of a probe, per call and over lagged windows. Pure.

Each probe call has a window: the `/cache` snapshots just before and just after it. A check
compares what the counters moved in a window with what the call's own evidence says. Halogen
Flash was measured to publish `prompt_tokens_saved`, `hits` and `misses` one call late, so a
check that fails per call is tried again with attribution shifted by one or two windows
("windowed"); passing only then means "the counters are right, but land L calls late".
A window whose `hits + misses` moved by more than one call is *interleaved* (foreign traffic);
no lagged check counts it or its neighbours, since a lagged count is published by whichever
request starts next and can trade places with a foreign one across adjacent windows.

Checks:
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

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import CacheCounters, CallEvidence
from prefixreg.server.counters import counter_deltas, is_interleaved

__all__ = ["LAGS", "CheckResult", "Status", "Window", "run_checks"]

Status = Literal["pass", "fail", "n/a", "info"]
LAGS: Final = (1, 2)


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

    def to_dict(self) -> JSONObject:
        return {
            "number": self.number,
            "title": self.title,
            "per_call": self.per_call,
            "windowed": self.windowed,
            "lag": self.lag,
            "detail": self.detail,
        }


Expect = Callable[[Window], dict[str, int] | None]


def _attributed(
    windows: Sequence[Window], targets: Sequence[int], expect: Expect, lag: int
) -> tuple[bool, int, list[str]]:
    """Do the windows `lag` calls after each target move as the target's expectation says?

    Returns (all matched, number compared, mismatch notes). Interleaved windows and calls
    without verified evidence are left out, not counted as passes.
    """
    compared, notes = 0, []
    for i in targets:
        j = i + lag
        if j >= len(windows):
            continue
        want = expect(windows[i])
        win = windows[j]
        # Lagged counters publish when the *next* request starts, whoever sends it, so a
        # foreign call can swap places with ours across adjacent windows: a window only
        # counts when no window from just before the target to just after the credited one
        # shows foreign traffic.
        span = windows[max(0, i - 1) : j + 2]
        if want is None or win.before is None or any(w.interleaved for w in span):
            continue
        compared += 1
        for name, value in want.items():
            got = win.delta(name)
            if got != value:
                notes.append(f"{windows[i].leg}@{windows[i].size}: {name} {got} != {value}")
    return not notes and compared > 0, compared, notes


def _lagged_check(
    number: int, title: str, windows: Sequence[Window], targets: Sequence[int], expect: Expect
) -> CheckResult:
    ok, compared, notes = _attributed(windows, targets, expect, 0)
    if ok:
        return CheckResult(number, title, "pass", "pass", 0, f"{compared} calls, per call")
    per_call: Status = "fail" if compared else "n/a"
    for lag in LAGS:
        ok_lag, n_lag, _ = _attributed(windows, targets, expect, lag)
        if ok_lag:
            late = "one call" if lag == 1 else f"{lag} calls"
            before = f"per call: {'; '.join(notes[:3])}. " if notes else ""
            detail = f"{before}Over windows: {n_lag} calls match when "
            detail += f"the counters land {late} late (counter lag {lag})."
            return CheckResult(number, title, per_call, "pass", lag, detail)
    if per_call == "n/a":
        return CheckResult(number, title, "n/a", "n/a", None, "no window to compare")
    return CheckResult(number, title, "fail", "fail", None, "; ".join(notes[:4]))


def _saved(w: Window) -> dict[str, int] | None:
    cached = w.evidence.cached_tokens
    if w.evidence.cache_state == "unverified" or cached is None:
        return None
    return {"prompt_tokens_saved": cached}


def _hit_miss(w: Window) -> dict[str, int] | None:
    if w.evidence.cache_state == "unverified":
        return None
    hit = w.evidence.cache_state == "reused"
    return {"hits": 1 if hit else 0, "misses": 0 if hit else 1}


def _full_from(windows: Sequence[Window]) -> int | None:
    for i, w in enumerate(windows):
        b = w.before
        if b is not None and b.entries is not None and b.entries == b.max_entries:
            return i
    return None


def _check_stores(windows: Sequence[Window], full: int | None) -> CheckResult:
    title = "stores delta equals evicted delta once the cache is full"
    if full is None:
        return CheckResult(3, title, "n/a", "n/a", None, "the cache never reported itself full")
    bad, n = [], 0
    for w in windows[full:]:
        s, e = w.delta("stores"), w.delta("evicted")
        if w.interleaved or s is None or e is None:
            continue
        n += 1
        if s != e:
            bad.append(f"{w.leg}@{w.size}: stores +{s}, evicted +{e}")
    status: Status = "fail" if bad else ("pass" if n else "n/a")
    return CheckResult(3, title, status, status, None, "; ".join(bad[:4]) or f"{n} calls")


def _check_entries(windows: Sequence[Window], full: int | None) -> CheckResult:
    title = "entries stays at max_entries once full"
    if full is None:
        return CheckResult(4, title, "n/a", "n/a", None, "the cache never reported itself full")
    bad = [
        f"{w.leg}@{w.size}: entries {w.after.entries} of {w.after.max_entries}"
        for w in windows[full:]
        if w.after is not None and w.after.entries != w.after.max_entries
    ]
    status: Status = "fail" if bad else "pass"
    first = windows[full].before
    size = None if first is None else first.max_entries
    return CheckResult(4, title, status, status, None, "; ".join(bad[:4]) or f"{size} entries")


def _check_entry_bytes(windows: Sequence[Window], sizes: Sequence[int]) -> CheckResult:
    title = "last_entry_bytes after the smallest vs the largest store"
    if len(set(sizes)) < 2:
        return CheckResult(5, title, "n/a", "n/a", None, "needs two sizes to compare")
    firsts = {w.size: w for w in windows if w.leg == "A1" and w.after is not None}
    small, large = (
        firsts.get(min(sizes)) if sizes else None,
        firsts.get(max(sizes)) if sizes else None,
    )
    if small is None or large is None or small.after is None or large.after is None:
        return CheckResult(5, title, "n/a", "n/a", None, "no /cache snapshots around A1")
    b_small, b_large = small.after.last_entry_bytes, large.after.last_entry_bytes
    if b_small is None or b_large is None:
        return CheckResult(5, title, "n/a", "n/a", None, "/cache reports no last_entry_bytes")
    if b_small == b_large:
        detail = (
            f"{b_small:,} bytes after both: a fixed entry size, so only cached_tokens can "
            "answer capacity"
        )
        return CheckResult(5, title, "info", "info", None, detail)
    p_small, p_large = small.evidence.prompt_tokens, large.evidence.prompt_tokens
    per = None
    if p_small is not None and p_large is not None and p_large != p_small:
        per = (b_large - b_small) / (p_large - p_small)
    detail = f"{b_small:,} -> {b_large:,} bytes: entries grow with the prompt"
    if per is not None:
        detail += f", about {per:,.0f} bytes per position"
    return CheckResult(5, title, "info", "info", None, detail)


def _check_refused(windows: Sequence[Window]) -> CheckResult:
    title = "refused stays 0"
    bad, n = [], 0
    for w in windows:
        r = w.delta("refused")
        if r is None:
            continue
        n += 1
        if r:
            prompt = w.evidence.prompt_tokens
            bad.append(
                f"+{r} on {w.leg}@{w.size} ({prompt} prompt tokens): the budget is too small"
            )
    if n == 0:
        return CheckResult(6, title, "n/a", "n/a", None, "/cache reports no refused counter")
    status: Status = "fail" if bad else "pass"
    return CheckResult(6, title, status, status, None, "; ".join(bad[:4]) or f"{n} calls")


def run_checks(windows: Sequence[Window], sizes: Sequence[int]) -> list[CheckResult]:
    """All six checks over the probe's calls, in the order they were made."""
    if not any(w.before is not None for w in windows):
        return [
            CheckResult(n, t, "n/a", "n/a", None, "the server has no /cache counters")
            for n, t in (
                (1, "prompt_tokens_saved delta across A2 equals its cached_tokens"),
                (2, "hits +1 / misses +0 across A2 and B, misses +1 across A1"),
                (3, "stores delta equals evicted delta once the cache is full"),
                (4, "entries stays at max_entries once full"),
                (5, "last_entry_bytes after the smallest vs the largest store"),
                (6, "refused stays 0"),
            )
        ]
    a2 = [i for i, w in enumerate(windows) if w.leg == "A2"]
    legs = [i for i, w in enumerate(windows) if w.leg in ("A1", "A2", "B")]
    full = _full_from(windows)
    return [
        _lagged_check(
            1, "prompt_tokens_saved delta across A2 equals its cached_tokens", windows, a2, _saved
        ),
        _lagged_check(
            2, "hits +1 / misses +0 across A2 and B, misses +1 across A1", windows, legs, _hit_miss
        ),
        _check_stores(windows, full),
        _check_entries(windows, full),
        _check_entry_bytes(windows, sizes),
        _check_refused(windows),
    ]

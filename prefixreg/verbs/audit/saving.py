"""What caching saved a batch, where its uncached tokens went, and its wall time. Pure.

Counterfactual, over the calls with valid counts (cached <= prompt, evidence not unverified):
cold, every prompt token is prefilled. A call with a plausible server timing cost `prompt_ms`, cold
`prompt / r` (`r`: the server's prefill rate on the batch's cold prefills, whose uncached share
is at least half the prompt, sum prefilled / sum seconds; else the given rate); one without cost
`(prompt - cached) / prefill_tps`, cold `prompt / prefill_tps`. Saved = cold - actual.

Plausibility: a server timing is used only when it is finite, at most `MAX_CALL_S`, non-zero
for a non-zero token count, and implies at most `MAX_TPS` tokens per second (`timed`); else the
call is modelled by rate, never a cold-rate sample, and listed by the report. A wall over
`MAX_CALL_S` is not used (`plausible_wall`). So the cold rate is within the samples' own rates
(at most `MAX_TPS`) and every sum of seconds stays finite.

Uncached split: a prompt is the head's span, then the rest of the previous call of its session
(`sessions.session_prefixes`: the prompt that call sent, which this one sent first), then what
it newly appended; each part's uncached tokens are those of it past the cached count. The head's
part is drift when the request drifted from the frame (the span is then the frame's byte
estimate, the drift named by the parts that drifted) or, read without a frame, when its first
message is not the batch's (`system`), else a miss of the head; the session's part is `session`
(a session prefix the call did not resume, `estimated` when only bytes measured it); the rest is
new history. With no head span, a session prefix still splits off; with neither, all is
unknown. The lever verdict is the judge's (`judge_lever`) on that split.

Wall: the batch's span (last end - first start) over the calls an input timed, plus the walls of
the others; concurrency by sweeping the intervals (a zero-length one, an HTTP error, counts at its
instant): the peak, and the mean (sum of intervals / span).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from prefixreg.core.judge import Judgement, LeverVerdict, estimate_span, judge_lever
from prefixreg.core.prefix import Drift
from prefixreg.core.records import CallEvidence
from prefixreg.verbs.audit.read import AuditCall
from prefixreg.verbs.audit.sessions import SessionPrefix, session_prefixes

COLD_SHARE = 0.5  # a call is a cold prefill when at least this share of its prompt was uncached
# No server prefills (or decodes) faster: real prefill rates are of the order of 1e3 to 1e5
# tokens/s on one node, so a timing implying more than ~100x the fastest is a broken or hostile
# number, and one such sample would otherwise set the cold rate of the whole batch.
MAX_TPS: Final = 1e7
# No HTTP call, or phase of one, lasts longer (~11.6 days); refusing longer ones also keeps the
# sums of seconds finite (a server's prompt_ms may be any finite float).
MAX_CALL_S: Final = 1e6


def timed(ms: float | None, tokens: int | None) -> tuple[float | None, str | None]:
    """A server timing of `ms` for `tokens` (None: count unknown): (seconds, None) when it is
    plausible, (None, why) when not, (None, None) when there is none."""
    if ms is None:
        return None, None
    seconds = ms / 1000
    said = f"{ms:g} ms" + ("" if tokens is None else f" for {tokens:,} tokens")
    if not (math.isfinite(seconds) and seconds <= MAX_CALL_S):
        return None, f"{said}: over {MAX_CALL_S:,.0f} s"
    if tokens and seconds <= 0:
        return None, f"{said}: no time for a non-zero count"
    if tokens and tokens > MAX_TPS * seconds:  # multiplied, never divided: no overflow
        return None, f"{said}: over {MAX_TPS:,.0f} tok/s"
    return seconds, None


def plausible_wall(ev: CallEvidence) -> float | None:
    """The call's wall time when it is one (at most `MAX_CALL_S`), else None."""
    return ev.wall_s if ev.wall_s is not None and ev.wall_s <= MAX_CALL_S else None


UNCACHED_PARTS: Final = ("new_history", "session", "drift", "miss", "unknown")


@dataclass(slots=True)
class CallSaving:
    """One call's counterfactual: its tokens, seconds cold and as served, its split."""

    source: str
    prompt: int
    cached: int
    cold_s: float
    actual_s: float
    drift: int = 0
    miss: int = 0
    new_history: int = 0
    session: int = 0  # of the previous call's prompt in its session, not resumed
    unknown: int = 0
    drifted: str | None = None  # the parts that drifted, comma-joined
    session_estimated: bool = False  # the session prefix is a byte estimate


@dataclass(slots=True)
class Saving:
    """The batch's counterfactual, summed over `calls`."""

    calls: list[CallSaving]
    cold_rate: float | None  # the server's rate on cold prefills, None: no timings had one
    rate_calls: int
    implausible: int = 0  # calls whose prompt timing was implausible: modelled by rate
    drift_parts: dict[str, int] = field(default_factory=dict)

    def total(self, key: str) -> Any:
        return sum(getattr(c, key) for c in self.calls)

    def lever(self) -> tuple[LeverVerdict, str]:
        keys = ("cached", "new_history", "session", "drift", "miss", "unknown")
        return judge_lever(**{k: self.total(k) for k in keys})

    def to_dict(self) -> dict[str, Any]:
        cold, actual = self.total("cold_s"), self.total("actual_s")
        verdict, why = self.lever()
        return {
            "calls": len(self.calls),
            "tokens": {"cold": self.total("prompt"), "saved": self.total("cached")},
            "seconds": {"cold": cold, "actual": actual, "saved": cold - actual},
            "cold_rate": {"tokens_per_s": self.cold_rate, "calls": self.rate_calls},
            "implausible_prompt_timings": self.implausible,
            "uncached": {k: self.total(k) for k in UNCACHED_PARTS},
            "session_estimated_calls": sum(c.session_estimated for c in self.calls if c.session),
            "drift_parts": dict(self.drift_parts),
            "lever": {"verdict": verdict, "reason": why},
        }


def saving(
    calls: Sequence[AuditCall],
    verdicts: Sequence[Judgement],
    *,
    prefill_tps: float,
    drifts: Mapping[str, tuple[Drift, ...]] | None = None,
    frame_bytes: int | None = None,
) -> Saving:
    """The counterfactual of `calls` (`verdicts[i]` the judge's on `calls[i]`); `drifts`:
    request source -> its drift from the frame of `frame_bytes` head bytes."""
    valid: list[tuple[AuditCall, Judgement, int, int]] = []  # (call, verdict, prompt, cached)
    prefixes = session_prefixes(calls)
    sessions: list[SessionPrefix | None] = []  # of the valid calls, in their order
    for c, v, prev in zip(calls, verdicts, prefixes, strict=True):
        p, k = c.evidence.prompt_tokens, c.evidence.cached_tokens
        if c.evidence.cache_state != "unverified" and p is not None and k is not None and k <= p:
            valid.append((c, v, p, k))
            sessions.append(prev)
    took = [timed(c.evidence.prompt_ms, p - k) for c, _, p, k in valid]
    # A cold sample has p - k > 0 tokens, so `timed` gave it seconds > 0: the sum is positive.
    cold = [
        (p - k, s)
        for (_, _, p, k), (s, _) in zip(valid, took, strict=True)
        if s is not None and p > 0 and p - k >= COLD_SHARE * p
    ]
    rate = sum(u for u, _ in cold) / sum(s for _, s in cold) if cold else None
    out = Saving([], rate, len(cold), sum(why is not None for _, why in took))
    for (c, v, p, k), (seconds, _), prev in zip(valid, took, sessions, strict=True):
        if seconds is not None:
            one = CallSaving(c.source, p, k, p / (rate or prefill_tps), seconds)
        else:
            one = CallSaving(c.source, p, k, p / prefill_tps, (p - k) / prefill_tps)
        drift = (drifts or {}).get(c.source) or ()
        one.drifted = ", ".join(sorted({d.part for d in drift})) or None
        span = v.span if v.span else None
        if drift and frame_bytes:
            span = estimate_span(p, frame_bytes, c.rest_bytes or 0)
        if span is None and prev is None:
            one.unknown = p - k
        else:
            # [0, head end) the head, [head end, session end) the session's rest, then new.
            head_end = min(span or 0, p)
            session_end = max(head_end, 0 if prev is None else min(prev.tokens, p))
            head = max(0, head_end - k)
            one.session = max(0, session_end - max(head_end, k))
            one.session_estimated = prev is not None and prev.source == "estimated"
            one.new_history = p - k - head - one.session
            if one.drifted:
                one.drift = head
                out.drift_parts[one.drifted] = out.drift_parts.get(one.drifted, 0) + head
            else:
                one.miss = head
        out.calls.append(one)
    return out


def batch_wall(calls: Sequence[AuditCall]) -> dict[str, Any]:
    """The batch's wall time: its span over the timed calls plus the walls of the rest."""
    pairs: list[tuple[int, int]] = []  # (start, end) of the calls an input timed
    loose: list[float] = []  # the walls of the calls it did not
    for c in calls:
        if c.start_ns is None or c.end_ns is None:
            if (wall := plausible_wall(c.evidence)) is not None:
                loose.append(wall)
        elif c.end_ns >= c.start_ns:
            pairs.append((c.start_ns, c.end_ns))
    span = (max(e for _, e in pairs) - min(s for s, _ in pairs)) / 1e9 if pairs else None
    # Sweep: at one instant, ends of others first, then starts, then zero-length ends.
    events = sorted([(s, 1, 1) for s, _ in pairs] + [(e, 0 if e > s else 2, -1) for s, e in pairs])
    peak = running = 0
    for _, _, step in events:
        running += step
        peak = max(peak, running)
    busy = sum(e - s for s, e in pairs) / 1e9
    return {
        "wall_s": (span or 0.0) + sum(loose) if pairs or loose else None,
        "wall_calls": len(pairs) + len(loose),
        "span_s": span,
        "span_calls": len(pairs),
        "summed_s": busy + sum(loose) if pairs or loose else None,
        "concurrency_peak": peak if pairs else None,
        "concurrency_mean": busy / span if span else None,
    }

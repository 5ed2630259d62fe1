"""The audit's report: totals, shares, the time model's closure, the shared prefix and the
system-prefix identity, as JSON (`to_dict`) and as text for a person (`to_text`).

Invariants:

- Every total carries the number of calls it covers; cached counts come only from verified
  (cold or reused) calls. Shares and totals of time are taken over the calls where both
  prefill and decode are known; closure = modelled / wall over the calls with a wall time.
- A prefix named only by token count is said to be a likeness, and when its sha is not in
  the registry consulted the text says "not registered".
- Unverified calls, malformed inputs and skipped files are listed with their reasons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.verbs.audit.framedrift import FrameAudit
from prefixreg.verbs.audit.identity import IdentityReport
from prefixreg.verbs.audit.match import PrefixMatch
from prefixreg.verbs.audit.read import AuditCall, Malformed
from prefixreg.verbs.audit.timemodel import CallTime

__all__ = ["AuditReport", "Dominant", "TokenStat"]

Dominant = Literal["prefill", "decode", "even"]


@dataclass(frozen=True, slots=True)
class TokenStat:
    """A total over the calls that reported the count, and how many did."""

    total: int
    calls: int

    @property
    def mean(self) -> float | None:
        return self.total / self.calls if self.calls else None

    def to_dict(self) -> JSONObject:
        return {"total": self.total, "mean": self.mean, "calls": self.calls}


def _stat(values: Sequence[int]) -> TokenStat:
    return TokenStat(sum(values), len(values))


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The accounting of one batch. `to_dict` is the `--json` form; `to_text` the table."""

    calls: tuple[AuditCall, ...]
    times: tuple[CallTime, ...]
    malformed: tuple[Malformed, ...]
    files: int
    prefill_tps: float
    decode_tps: float
    rates_given: bool
    prefix: PrefixMatch | None
    skipped: tuple[Malformed, ...] = ()
    identity: IdentityReport | None = None
    frame: FrameAudit | None = None  # `audit --frame`: each request's drift from the frame

    # -- counts ---------------------------------------------------------------------------

    def states(self) -> dict[str, int]:
        out = {"cold": 0, "reused": 0, "unverified": 0}
        for c in self.calls:
            out[c.evidence.cache_state] += 1
        return out

    def tokens(self) -> dict[str, TokenStat]:
        """Totals and means, each over the calls that reported that count. Cached counts come
        only from verified (cold or reused) calls: elsewhere they are not evidence."""
        evs = [c.evidence for c in self.calls]
        verified = [e for e in evs if e.cache_state != "unverified"]
        return {
            "prompt": _stat([e.prompt_tokens for e in evs if e.prompt_tokens is not None]),
            "cached": _stat([e.cached_tokens for e in verified if e.cached_tokens is not None]),
            "cached_when_reused": _stat(
                [e.cached_tokens for e in verified if e.cached_tokens and e.cached_tokens > 0]
            ),
            "completion": _stat(
                [e.completion_tokens for e in evs if e.completion_tokens is not None]
            ),
        }

    def cached_share(self) -> float | None:
        """Cached / prompt tokens over the verified calls (both counts are known there)."""
        pairs = [
            (c.evidence.cached_tokens, c.evidence.prompt_tokens)
            for c in self.calls
            if c.evidence.cache_state != "unverified"
        ]
        cached = sum(a or 0 for a, _ in pairs)
        prompt = sum(b or 0 for _, b in pairs)
        return _share(cached, prompt)

    # -- time -----------------------------------------------------------------------------

    def _modelled(self) -> list[tuple[AuditCall, CallTime]]:
        return [(c, t) for c, t in zip(self.calls, self.times, strict=True) if t.modelled]

    def prefill_s(self) -> float:
        return sum(t.prefill_s or 0.0 for _, t in self._modelled())

    def decode_s(self) -> float:
        return sum(t.decode_s or 0.0 for _, t in self._modelled())

    def prefill_share(self) -> float | None:
        return _share(self.prefill_s(), self.prefill_s() + self.decode_s())

    def dominant(self) -> Dominant | None:
        """Which share of the modelled time is larger (None: nothing could be modelled)."""
        share = self.prefill_share()
        if share is None:
            return None
        if math.isclose(share, 0.5, abs_tol=1e-9):
            return "even"
        return "prefill" if share > 0.5 else "decode"

    def wall(self) -> tuple[float, int]:
        walls = [c.wall_s for c in self.calls if c.wall_s is not None]
        return sum(walls), len(walls)

    def closure(self) -> tuple[float | None, int]:
        """(modelled / wall, calls) over the calls with both a model and a wall time."""
        both = [(c, t) for c, t in self._modelled() if c.wall_s is not None]
        wall = sum(c.wall_s or 0.0 for c, _ in both)
        model = sum((t.prefill_s or 0.0) + (t.decode_s or 0.0) for _, t in both)
        return _share(model, wall), len(both)

    def sources(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {
            "prefill": {"timings": 0, "rates": 0, "unknown": 0},
            "decode": {"timings": 0, "rates": 0, "unknown": 0},
        }
        for t in self.times:
            out["prefill"][t.prefill_source or "unknown"] += 1
            out["decode"][t.decode_source or "unknown"] += 1
        return out

    def unverified(self) -> list[Malformed]:
        """The calls that count as unverified, with the reason their evidence gives."""
        return [
            Malformed(c.source, c.evidence.reason or c.evidence.error or "unverified")
            for c in self.calls
            if c.evidence.cache_state == "unverified"
        ]

    def summary(self) -> str:
        """One sentence: which share dominates, and whether caching is the lever."""
        dominant, share = self.dominant(), self.prefill_share()
        if dominant is None or share is None:
            return "no call reported the counts or timings needed to model its time"
        if dominant == "prefill":
            return (
                f"prefill dominates: {round(share * 100)}% of modelled time; "
                "prompt caching is the lever"
            )
        if dominant == "decode":
            return (
                f"decode dominates: {round((1 - share) * 100)}% of modelled time; "
                "prompt caching is not the lever for this batch"
            )
        return "prefill and decode are even: 50% of modelled time each"

    def to_dict(self) -> JSONObject:
        wall, wall_n = self.wall()
        closure, closure_n = self.closure()
        share = self.prefill_share()
        modelled = self._modelled()
        tokens: dict[str, JSONValue] = {k: v.to_dict() for k, v in self.tokens().items()}
        sources: dict[str, JSONValue] = {k: dict(v) for k, v in self.sources().items()}
        return {
            "files": self.files,
            "calls": len(self.calls),
            "calls_with_cached_tokens": self.states()["reused"],
            "states": dict(self.states()),
            "tokens": tokens,
            "cached_share": self.cached_share(),
            "time": {
                "wall_s": wall if wall_n else None,
                "wall_calls": wall_n,
                "modelled_calls": len(modelled),
                "prefill_s": self.prefill_s() if modelled else None,
                "decode_s": self.decode_s() if modelled else None,
                "prefill_share": share,
                "decode_share": None if share is None else 1 - share,
                "dominant": self.dominant(),
                "closure": closure,
                "closure_calls": closure_n,
                "sources": sources,
                "rates": {
                    "prefill_tps": self.prefill_tps,
                    "decode_tps": self.decode_tps,
                    "given": self.rates_given,
                },
            },
            "summary": self.summary(),
            "shared_prefix": None if self.prefix is None else self.prefix.to_dict(),
            "system_prefix": None if self.identity is None else self.identity.to_dict(),
            "frame": None if self.frame is None else self.frame.to_dict(),
            "unverified": [u.to_dict() for u in self.unverified()],
            "malformed": [m.to_dict() for m in self.malformed],
            "skipped": [m.to_dict() for m in self.skipped],
        }

    def to_text(self, *, limit: int = 10) -> str:
        """The report for a person: a short table, the verdict sentence, then what was skipped."""
        st = self.states()
        tok = self.tokens()
        lines = [
            f"calls          {len(self.calls):,} from {self.files:,} files "
            f"(reused {st['reused']:,}, cold {st['cold']:,}, unverified {st['unverified']:,})",
            f"{'tokens':<14} {'total':>14} {'mean':>12} {'calls':>8}",
        ]
        for label, key in (
            ("prompt", "prompt"),
            ("cached", "cached"),
            ("  if reused", "cached_when_reused"),
            ("completion", "completion"),
        ):
            row = tok[key]
            shown = "-" if row.mean is None else f"{row.mean:,.1f}"
            lines.append(f"  {label:<12} {row.total:>14,} {shown:>12} {row.calls:>8,}")
        share = self.cached_share()
        if share is not None:
            lines.append(f"cached share   {share:.1%} of prompt tokens (verified calls)")
        wall, wall_n = self.wall()
        lines.append(
            f"wall time      {_secs(wall)} over {wall_n:,} calls" if wall_n else "wall time      -"
        )
        modelled = self._modelled()
        psh = self.prefill_share()
        if modelled and psh is not None:
            lines.append(
                f"modelled       prefill {_secs(self.prefill_s())} ({psh:.0%}), "
                f"decode {_secs(self.decode_s())} ({1 - psh:.0%}) over {len(modelled):,} calls"
            )
            closure, closure_n = self.closure()
            if closure is not None:
                lines.append(
                    f"closure        modelled time is {closure:.0%} of measured wall time "
                    f"({closure_n:,} calls)"
                )
        src = self.sources()
        lines.append(
            "sources        prefill: "
            + _sources_text(src["prefill"], f"{self.prefill_tps:,.0f} tok/s")
            + "; decode: "
            + _sources_text(src["decode"], f"{self.decode_tps:,.0f} tok/s")
            + ("" if self.rates_given else " (default rates: the measured Halogen Flash lane)")
        )
        lines.append(f"shared prefix  {self._prefix_text()}")
        if self.identity is not None:
            lines.extend(self.identity.text_lines(limit=limit))
        if self.frame is not None:
            lines.extend(self.frame.text_lines(limit=limit))
        lines.append(self.summary())
        for title, items in (
            ("unverified", self.unverified()),
            ("malformed", self.malformed),
            ("skipped", self.skipped),
        ):
            if items:
                lines.append(f"{title} ({len(items):,}):")
                lines.extend(f"  {m.source}: {m.reason}" for m in items[:limit])
                if len(items) > limit:
                    lines.append(f"  ... and {len(items) - limit:,} more (see --json)")
        return "\n".join(lines) + "\n"

    def _prefix_text(self) -> str:
        p = self.prefix
        if p is None:
            return (
                "none matched (no resumed span measured on the batch's build lies near its "
                "mean cached count)"
            )
        if p.registered is None:
            state = "; registry not consulted"
        else:
            state = "" if p.registered else "; NOT registered in this registry"
        if p.method == "records":
            return f"{p.label()} (named by the measurement records read{state})"
        where = f"build {p.build_id}" + ("" if p.build_known else ", the batch's build unknown")
        return (
            f"{p.label()}: mean cached {p.mean_cached or 0:,.0f} vs measured span "
            f"{p.span_tokens or 0:,} on {where} (within {p.tolerance or 0:,}; "
            f"a token-count likeness, not byte identity{state})"
        )


def _secs(value: float) -> str:
    """Seconds for a person: three significant digits under 100 s (a fast simulator's
    milliseconds must not print as 0.00), grouped whole seconds above."""
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


def _sources_text(counts: Mapping[str, int], rate: str) -> str:
    parts = []
    if counts["timings"]:
        parts.append(f"{counts['timings']:,} by server timings")
    if counts["rates"]:
        parts.append(f"{counts['rates']:,} by rate ({rate})")
    if counts["unknown"]:
        parts.append(f"{counts['unknown']:,} unknown")
    return ", ".join(parts) or "-"

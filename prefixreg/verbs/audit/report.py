"""The audit's report: totals, the judge's states, the time model, the shared head, the identity
and the frame drift, as JSON (`to_dict`) and as text (`to_text`).

Invariants: totals are the server's numbers, each with the calls it covers, cached counts only
from verified evidence, whatever the judge's label; states are the judge's (`resumed` shown as
`reused`), partial and unverified calls listed with its reason. Time: server `timings` win, else
prefill = (prompt - cached) / prefill_tps, decode = completion / decode_tps; a missing count is
never zero (the figure is unknown); shares over the calls with both figures, closure = modelled /
wall over those with a wall time. A server timing or wall that is not plausible (`saving.timed`,
`plausible_wall`) is not used, and listed as `implausible`; a given rate is within [`MIN_TPS`,
`MAX_TPS`]. A head named by coverage is said to be a likeness, one outside
the registry "not registered".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Judgement
from prefixreg.core.prefix import Drift
from prefixreg.core.records import CallEvidence
from prefixreg.verbs.audit.identity import FrameAudit, IdentityReport, listing
from prefixreg.verbs.audit.read import AuditCall, Malformed
from prefixreg.verbs.audit.saving import (
    MAX_CALL_S,
    MAX_TPS,
    Saving,
    batch_wall,
    plausible_wall,
    saving,
    timed,
)

Method = Literal["identity", "records", "coverage"]


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """A head's span on one build, from its latest resumed check: `measured` (the server's
    cached count), or `estimated` (an aligned engine's: the estimate that check covered)."""

    sha256: str
    build_id: str
    span_tokens: int
    alignment: int
    at: str
    kind: str
    frame: str | None = None
    source: Literal["measured", "estimated"] = "measured"

    @property
    def head(self) -> str:
        """The head's id: the frame's sha for a frame, else the prefix's."""
        return self.frame or self.sha256


@dataclass(frozen=True, slots=True)
class SharedHead:
    """The head a batch shares, how it was named (`support` of `of` requests or calls back
    it), and its measured span on the batch's build, if any."""

    sha256: str
    frame: str | None
    names: tuple[str, ...]
    method: Method
    registered: bool | None
    support: int
    of: int
    build_known: bool
    span: PrefixSpan | None

    def label(self) -> str:
        kind = "frame " if self.frame else ""
        head, name = self.frame or self.sha256, ", ".join(self.names)
        return f"{kind}{name} ({head[:12]})" if name else f"{kind}{head}"


# The measured Halogen Flash lane (the simulator's defaults model the same lane).
DEFAULT_PREFILL_TPS: Final = 1180.0
DEFAULT_DECODE_TPS: Final = 60.0
STATES: Final = {"resumed": "reused"} | {s: s for s in ("partial", "cold", "unverified")}
# A given rate slower than this (a token per ~17 minutes) is no server's; with MAX_TPS above,
# it keeps every modelled second finite and every share a number.
MIN_TPS: Final = 1e-3


def _phase(ms: float | None, tokens: int | None, tps: float) -> tuple[float | None, str]:
    """(seconds or None, "timings" | "rates" | "unknown"): a plausible server timing wins."""
    seconds, _ = timed(ms, tokens)
    if seconds is not None:
        return seconds, "timings"
    return (None, "unknown") if tokens is None else (tokens / tps, "rates")


def _uncached(ev: CallEvidence) -> int | None:
    p, k = ev.prompt_tokens, ev.cached_tokens
    return None if p is None or k is None or k > p else p - k  # needs cached <= prompt


def rates(prefill_tps: float | None, decode_tps: float | None) -> tuple[float, float]:
    """The rates, defaults applied. Raises `UsageError`: a rate is not a positive number."""
    prefill = _rate(prefill_tps, DEFAULT_PREFILL_TPS, "prefill")
    return prefill, _rate(decode_tps, DEFAULT_DECODE_TPS, "decode")


def _rate(rate: object, default: float, what: str) -> float:
    value = default if rate is None else rate  # callers outside the type checker pass anything
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else 0
    if not (math.isfinite(number) and MIN_TPS <= number <= MAX_TPS):
        raise UsageError(
            f"--{what}-tps must be a positive number of tokens per second, "
            f"from {MIN_TPS:g} to {MAX_TPS:,.0f}"
        )
    return float(number)


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def _stat(values: list[int | None]) -> JSONObject:
    known = [v for v in values if v is not None]
    mean = sum(known) / len(known) if known else None
    return {"total": sum(known), "mean": mean, "calls": len(known)}


def _secs(value: float) -> str:
    """3 significant digits under 100 s (a simulator's ms must not print as 0.00), else whole."""
    return f"{value:.3g} s" if value < 100 else f"{value:,.0f} s"


@dataclass(frozen=True, slots=True)
class AuditReport:
    """The accounting of one batch; `verdicts[i]` is the judge's verdict on `calls[i]`."""

    calls: tuple[AuditCall, ...]
    verdicts: tuple[Judgement, ...]
    malformed: tuple[Malformed, ...]
    skipped: tuple[Malformed, ...]
    files: int
    prefill_tps: float
    decode_tps: float
    rates_given: bool
    prefix: SharedHead | None
    identity: IdentityReport | None = None
    frame: FrameAudit | None = None

    def states(self) -> dict[str, int]:
        return {s: sum(STATES[v.verdict] == s for v in self.verdicts) for s in STATES.values()}

    def listed(self, verdict: str) -> list[Malformed]:
        """The calls the judge gave `verdict`, with its reason."""
        pairs = zip(self.calls, self.verdicts, strict=True)
        return [Malformed(c.source, v.reason) for c, v in pairs if v.verdict == verdict]

    def implausible(self) -> list[Malformed]:
        """The server timings and walls not used, each with why."""
        out = []
        for c in self.calls:
            ev = c.evidence
            for name, ms, tokens in (
                ("prompt_ms", ev.prompt_ms, _uncached(ev)),
                ("predicted_ms", ev.predicted_ms, ev.completion_tokens),
            ):
                if (why := timed(ms, tokens)[1]) is not None:
                    out.append(Malformed(c.source, f"{name} {why}: not used (modelled by rate)"))
            if ev.wall_s is not None and plausible_wall(ev) is None:
                why = f"wall {ev.wall_s:g} s: over {MAX_CALL_S:,.0f} s: not used"
                out.append(Malformed(c.source, why))
        return out

    def _time(self) -> dict[str, Any]:
        sources = {k: {"timings": 0, "rates": 0, "unknown": 0} for k in ("prefill", "decode")}
        model = []
        for c in self.calls:
            ev = c.evidence
            prefill_s, prefill_from = _phase(ev.prompt_ms, _uncached(ev), self.prefill_tps)
            decode_s, decode_from = _phase(ev.predicted_ms, ev.completion_tokens, self.decode_tps)
            sources["prefill"][prefill_from] += 1
            sources["decode"][decode_from] += 1
            if prefill_s is not None and decode_s is not None:
                model.append((plausible_wall(ev), prefill_s, decode_s))
        both = [(w, p + d) for w, p, d in model if w is not None]
        prefill, decode = sum(p for _, p, _ in model), sum(d for _, _, d in model)
        share = _share(prefill, prefill + decode)
        dominant = None if share is None else "prefill" if share > 0.5 else "decode"
        return batch_wall(self.calls) | {
            "modelled_calls": len(model),
            "prefill_s": prefill if model else None,
            "decode_s": decode if model else None,
            "prefill_share": share,
            "decode_share": None if share is None else 1 - share,
            "dominant": "even" if share is not None and math.isclose(share, 0.5) else dominant,
            "closure": _share(sum(m for _, m in both), sum(w for w, _ in both)),
            "closure_calls": len(both),
            "sources": sources,
            "rates": {
                "prefill_tps": self.prefill_tps,
                "decode_tps": self.decode_tps,
                "given": self.rates_given,
            },
        }

    def saved(self) -> Saving:
        """The counterfactual: what the batch would have cost cold, and the uncached split."""
        drifts: dict[str, tuple[Drift, ...]] = {}
        if self.frame is not None:
            drifts = {source: drift for source, drift, _ in self.frame.rows}
        elif self.identity is not None:  # the batch's prefix is the head
            batch = str(self.identity.batch_sha)[:12]
            for p in self.identity.of("drifted"):
                why = f"messages[0] is {str(p.system.sha256)[:12]}, not {batch}"
                drifts[p.source] = (Drift("system", why),)
        size = self.frame.frame.head_bytes if self.frame else None
        return saving(
            self.calls, self.verdicts, prefill_tps=self.prefill_tps, drifts=drifts, frame_bytes=size
        )

    def summary(self, time: dict[str, Any] | None = None, lever: Saving | None = None) -> str:
        """One sentence: which share of the time dominates, then whether caching is the
        lever (the judge's, from the uncached split: the same on every engine)."""
        t = time or self._time()
        verdict, why = (lever or self.saved()).lever()
        words = {"lever": "the lever", "not_lever": "not the lever", "unverified": "unverified"}
        said = f"prompt caching is {words[verdict]}: {why}"
        if t["dominant"] is None:
            return f"no call reported the counts or timings needed to model its time; {said}"
        if t["dominant"] == "even":
            return f"prefill and decode are even: 50% of modelled time each; {said}"
        pct = round(t[f"{t['dominant']}_share"] * 100)
        return f"{t['dominant']} dominates: {pct}% of modelled time; {said}"

    def to_dict(self) -> JSONObject:
        evs = [c.evidence for c in self.calls]
        ok = [e for e in evs if e.cache_state != "unverified"]
        reused = [c.evidence for c, v in zip(self.calls, self.verdicts, strict=True) if v.resumed]
        time, saved = self._time(), self.saved()
        return {
            "files": self.files,
            "calls": len(self.calls),
            "calls_with_cached_tokens": sum(1 for e in ok if e.cached_tokens),
            "states": dict(self.states()),
            "tokens": {
                "prompt": _stat([e.prompt_tokens for e in evs]),
                "cached": _stat([e.cached_tokens for e in ok]),
                "cached_when_reused": _stat([e.cached_tokens for e in reused]),
                "completion": _stat([e.completion_tokens for e in evs]),
            },
            "cached_share": _share(
                sum(e.cached_tokens or 0 for e in ok), sum(e.prompt_tokens or 0 for e in ok)
            ),
            "time": time,
            "saving": saved.to_dict(),
            "summary": self.summary(time, saved),
            "shared_prefix": None if self.prefix is None else asdict(self.prefix),
            "system_prefix": None if self.identity is None else self.identity.to_dict(),
            "frame": None if self.frame is None else self.frame.to_dict(),
            **{k: [asdict(m) for m in self.listed(k)] for k in ("partial", "unverified")},
            "implausible": [asdict(m) for m in self.implausible()],
            "malformed": [asdict(m) for m in self.malformed],
            "skipped": [asdict(m) for m in self.skipped],
        }

    def to_text(self, *, limit: int = 10) -> str:
        """The report for a person: a short table, the verdict sentence, then the lists."""
        d: dict[str, Any] = self.to_dict()
        t, states = d["time"], ", ".join(f"{k} {n:,}" for k, n in d["states"].items())
        lines = [
            f"calls          {d['calls']:,} from {d['files']:,} files ({states})",
            f"{'tokens':<14} {'total':>14} {'mean':>12} {'calls':>8}",
        ]
        for key, row in d["tokens"].items():
            label = "  if reused" if key == "cached_when_reused" else key
            mean = "-" if row["mean"] is None else f"{row['mean']:,.1f}"
            lines.append(f"  {label:<12} {row['total']:>14,} {mean:>12} {row['calls']:>8,}")
        if (share := d["cached_share"]) is not None:
            lines.append(
                f"cached share   {share:.1%} of prompt tokens (calls that reported a count)"
            )
        lines += [f"wall time      {_wall_text(t)}", *_saving_lines(d["saving"])]
        if t["prefill_share"] is not None:
            prefill, decode = _secs(t["prefill_s"]), _secs(t["decode_s"])
            lines.append(
                f"modelled       prefill {prefill} ({t['prefill_share']:.0%}), decode {decode} "
                f"({t['decode_share']:.0%}) over {t['modelled_calls']:,} calls"
            )
        if t["modelled_calls"] and t["closure"] is not None:
            lines.append(
                f"closure        modelled time is {t['closure']:.0%} of measured wall time "
                f"({t['closure_calls']:,} calls)"
            )
        rates = "" if self.rates_given else " (default rates: the measured Halogen Flash lane)"
        lines += [
            f"sources        prefill: {_sources(t['sources']['prefill'], self.prefill_tps)}; "
            f"decode: {_sources(t['sources']['decode'], self.decode_tps)}{rates}",
            f"shared prefix  {self._prefix_text()}",
            *(self.identity.text_lines(limit=limit) if self.identity else []),
            *(self.frame.text_lines(limit=limit) if self.frame else []),
            d["summary"],
        ]
        for title in ("partial", "unverified", "implausible", "malformed", "skipped"):
            items = [f"{m['source']}: {m['reason']}" for m in d[title]]
            lines += listing(title, items, limit)
        return "\n".join(lines) + "\n"

    def _prefix_text(self) -> str:
        if (p := self.prefix) is None:
            return (
                "none named (no registered head the requests send byte-identically, and no "
                "measured span on the batch's build that the calls read alone cover)"
            )
        unregistered = "; NOT registered in this registry"
        state = {None: "; registry not consulted", True: ""}.get(p.registered, unregistered)
        if p.method == "identity":
            return f"{p.label()} (byte identity: {p.support:,} of {p.of:,} requests send it{state})"
        if p.method == "records" or p.span is None:
            return f"{p.label()} (named by the measurement records read{state})"
        unknown = "" if p.build_known else ", the batch's build unknown"
        return (
            f"{p.label()}: {p.support:,} of {p.of:,} calls read alone cover its "
            f"{p.span.source} span of {p.span.span_tokens:,} tokens on build {p.span.build_id}"
            f"{unknown} (a "
            f"token-count likeness, not byte identity{state})"
        )


def _wall_text(t: dict[str, Any]) -> str:
    if not t["wall_calls"]:
        return "-"
    if t["span_s"] is None:
        return f"{_secs(t['wall_s'])}: {t['wall_calls']:,} call times summed (no start times)"
    rest = t["wall_calls"] - t["span_calls"]
    more = f", plus {rest:,} untimed calls summed" if rest else ""
    return (
        f"{_secs(t['wall_s'])}: the batch's span over {t['span_calls']:,} calls{more} "
        f"(concurrency peak {t['concurrency_peak']}, mean {t['concurrency_mean'] or 0:.2f}; "
        f"calls summed {_secs(t['summed_s'])})"
    )


def _saving_lines(s: dict[str, Any]) -> list[str]:
    if not s["calls"]:
        return []
    tok, sec, u = s["tokens"], s["seconds"], s["uncached"]
    rate, odd = s["cold_rate"]["tokens_per_s"], s["implausible_prompt_timings"]
    how = f"the server's {_tps(rate)} on cold prefills" if rate else "the rates"
    if odd:  # said where the rate is, and listed under `implausible`
        how += f"; server timings not used, implausible: {odd:,}"
    parts = ", ".join(f"{k} {n:,}" for k, n in s["drift_parts"].items())
    parts = f" ({parts})" if parts else ""
    n = s["session_estimated_calls"]
    est = f" (estimated by bytes for {n:,} calls)" if n else ""
    # A loss is said as one, never shown as 0 s saved (the server's timings can show it).
    saved = f"{_secs(sec['saved'])} of prefill" if sec["saved"] >= 0 else "no prefill time"
    lost = "" if sec["saved"] >= 0 else f"; prefill took {_secs(-sec['saved'])} more than cold"
    return [
        f"if cold        {tok['cold']:,} prompt tokens, prefill {_secs(sec['cold'])} ({how})",
        f"caching saved  {tok['saved']:,} tokens, {saved} "
        f"(took {_secs(sec['actual'])}{lost}) over {s['calls']:,} calls",
        f"uncached       new history {u['new_history']:,}, session {u['session']:,}{est}, "
        f"drift {u['drift']:,}{parts}, head missed {u['miss']:,}, unknown {u['unknown']:,}",
    ]


def _tps(rate: float) -> str:
    """A rate: whole tokens/s, 3 significant digits under 100 (a given 0.5 is not 0 tok/s)."""
    return f"{rate:.3g} tok/s" if rate < 100 else f"{rate:,.0f} tok/s"


def _sources(counts: dict[str, int], tps: float) -> str:
    how = {"timings": "by server timings", "rates": f"by rate ({_tps(tps)})"}
    return ", ".join(f"{n:,} {how.get(k, k)}" for k, n in counts.items() if n) or "-"

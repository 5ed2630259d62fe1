"""`ProbeReport`: a probe's calls, checks and survival search, as the JSON receipt, the
Markdown a person reads, and what the numbers mean (`follows`). Pure.

Invariants:
- Every verdict is the judge's (`core.judge`); nothing here compares a cached count with a
  span. Where the engine's alignment let a count pass, the text names it.
- Every number shown is a server-reported count or a wall time the client measured; a value
  the server did not report is shown as `-` or said to be unverified, never as zero.
- `outcome` is `ok` only when something was verified: a judged leg (A1 aside) the judge
  calls unverified, a survival trial whose count was unverified, or a run whose checks are
  all `n/a` on a server that has `/cache` makes it `unverified`.

`DemoRun`: `prefixreg demo`'s result (a warm and a probe), its outcome the worse of the two.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import alignment_shaped, judge_survival
from prefixreg.core.records import ServerBuild
from prefixreg.verbs.probe.checks import CheckResult, ProbeCall
from prefixreg.verbs.probe.options import ProbeOptions

if TYPE_CHECKING:
    from prefixreg.verbs.measure.warm import WarmResult

Outcome = Literal["ok", "check_failed", "unverified"]
ANSWERS: Final = {
    "A1": "cold baseline",
    "A2": "positions one entry holds",
    "B": "what a fresh call resumes",
    "C": "does the prefix survive the LRU?",
    "bisect-A1": "cold baseline (bisecting Cmax)",
    "bisect-B": "what a fresh call resumes (bisecting Cmax)",
}


@dataclass(slots=True)
class ProbeReport:
    """The receipt of one probe run."""

    run_id: str
    at: str
    worker: str
    build: ServerBuild
    options: ProbeOptions
    calls: list[ProbeCall] = field(default_factory=list)
    checks: list[CheckResult] = field(default_factory=list)
    survival: int | None = None
    survival_searched: bool = False
    survival_trials: list[tuple[int, bool | None]] = field(default_factory=list)
    alignment: int = 0
    json_path: str | None = None
    md_path: str | None = None
    qualify: str | None = None  # this build's latest `qualify` run, in its receipt's words

    def text(self, _exit_code: int = 0) -> str:
        """The verdict a person reads, then where the run's files are."""
        return self.to_markdown() + f"\nreceipt: {self.json_path}\nverdict: {self.md_path}\n"

    def legs(self, leg: str) -> list[ProbeCall]:
        return [c for c in self.calls if c.leg == leg]

    def fresh(self) -> list[ProbeCall]:
        """The fresh-tail legs, by size: each size's B and the bisection's."""
        return sorted(self.legs("B") + self.legs("bisect-B"), key=lambda c: c.size or 0)

    @property
    def cmax(self) -> int | None:
        """The largest cached count a fresh-tail call (B) was served, of the B legs whose
        counts the judge took (not unverified): the measured Cmax (the bracket's bottom)."""
        counts = [
            c.record.evidence.cached_tokens for c in self.fresh() if c.verdict != "unverified"
        ]
        return max((n for n in counts if n is not None), default=None)

    def _first_miss(self) -> ProbeCall | None:
        resumed = [c.size or 0 for c in self.fresh() if c.verdict == "resumed"]
        top = max(resumed, default=0)
        missed = (
            c for c in self.fresh() if c.verdict in ("partial", "cold") and (c.size or 0) > top
        )
        return next(missed, None)

    def size_bracket(self) -> tuple[int | None, int | None]:
        """(the largest size whose fresh tail resumed, the first larger one that did not), in
        characters; None where there is none."""
        resumed = [c.size for c in self.fresh() if c.verdict == "resumed" and c.size]
        miss = self._first_miss()
        return max(resumed, default=None), None if miss is None else miss.size

    @property
    def cmax_below(self) -> int | None:
        """The bracket's top: Cmax is below the span of the first size above every resumed one
        whose fresh tail did not resume (its entry could not hold it); None: no such size."""
        miss = self._first_miss()
        if miss is None or miss.judgement is None:
            return None
        return miss.judgement.span or miss.record.evidence.prompt_tokens

    @property
    def stores_per_prompt(self) -> int | None:
        """Entries one foreign prompt stores, read from the counters (median; None: no /cache)."""
        moved = [c.delta("stores") for c in self.legs("foreign") if not c.interleaved]
        deltas = sorted(d for d in moved if d is not None)
        return deltas[len(deltas) // 2] if deltas else None

    @property
    def has_cache(self) -> bool:
        return any(c.record.before is not None for c in self.calls)

    @property
    def checks_unverified(self) -> bool:
        """Every counter check is n/a on a server that has `/cache`: nothing was compared."""
        blind = bool(self.checks) and all(c.per_call == "n/a" for c in self.checks)
        return blind and (self.build.profile == "halogen" or self.has_cache)

    @property
    def survival_unverified(self) -> bool:
        """The survival search ran but a trial's answer was unverified: no number."""
        return self.survival_searched and self.survival is None

    @property
    def outcome(self) -> Outcome:
        """`unverified` (module docstring), else `check_failed` beyond the lag, else `ok`."""
        legs = any(c.verdict == "unverified" and c.leg != "A1" for c in self.calls)
        if legs or self.survival_unverified or self.checks_unverified:
            return "unverified"
        return "check_failed" if any(c.failed for c in self.checks) else "ok"

    def leg_seconds(self) -> dict[str, dict[int, float | None]]:
        """Wall seconds of each answering leg, by size: the report's per-leg timings."""
        out: dict[str, dict[int, float | None]] = {}
        for c in self.calls:
            if c.leg in ANSWERS and c.size is not None:
                out.setdefault(c.leg, {})[c.size] = c.record.evidence.wall_s
        return {leg: out[leg] for leg in ANSWERS if leg in out}

    def _aligned(self) -> str:
        return f" (counted in multiples of {self.alignment:,})" if self.alignment > 1 else ""

    @property
    def cmax_floor(self) -> bool:
        """Whether Cmax is only a lower bound: every size resumed whole, so none found the
        cache's reach."""
        b_legs = self.fresh()
        return self.cmax is not None and all(c.verdict == "resumed" for c in b_legs)

    def follows(self) -> list[str]:
        """What the numbers mean for prefix caching on this server, in plain words."""
        out: list[str] = []
        say, align, cmax = out.append, self.alignment, self.cmax
        b_legs, a1 = self.legs("B"), self.legs("A1")
        short = [c for c in b_legs if c.verdict == "partial"]
        missing = [c for c in b_legs if c.verdict in ("cold", "unverified")]
        if cmax is not None and short:
            text = f"Cmax {cmax:,}{self._aligned()} is below the prefix sizes in use "
            text += f"({_sizes(short)} characters resumed only in part): on this server the design "
            say(text + "does not reach past the part of a prefix one entry holds.")
        if missing:
            prompts = [c.record.evidence.prompt_tokens for c in missing]
            below = align > 1 and all(p is not None and p < align for p in prompts)
            why = f"each prompt is shorter than the {align:,}-token alignment" if below else ""
            sizes = ", ".join(f"{c.size:,} ({c.verdict})" for c in missing)
            say(f"A fresh tail did not resume {sizes} characters: {why or 'no reuse reported'}.")
        if cmax is not None and not short and not missing:
            shaped = any(c.judgement and alignment_shaped(c.judgement) for c in b_legs)
            how = f"within the {align:,}-token alignment" if shaped else "whole"
            say(f"Every size resumed {how} from a fresh tail; Cmax is at least {cmax:,} tokens.")
        if partly := [c for c in a1 if c.verdict == "partial"]:
            most = max(c.record.evidence.cached_tokens or 0 for c in partly)
            text = f"{len(partly)} cold baselines were served in part from cache (up to {most:,} "
            text += "leading tokens shared with earlier prompts: the chat template, the probe's "
            say(text + "header): the judge calls them partial, not resumed.")
        if warm := [c for c in a1 if c.verdict == "resumed"]:
            text = f"The cold baseline at {_sizes(warm)} characters resumed the prefix: it is no "
            say(text + "cold baseline, and A1 vs B timings there mean nothing.")
        if unproven := [c for c in a1 if c.verdict == "unverified"]:
            text = f"{len(unproven)} cold baselines are unverified: this server omits "
            text += "cached_tokens when nothing was cached and sends no timings.cache_n, so a cold "
            say(text + "call cannot be proven cold (a missing count is never zero).")
        if align > 1:
            never = f"prompts under {align} tokens never resume"
            say(f"Cached counts are multiples of {align}: {never}.")
        if self.survival_unverified:
            open_n = [n for n, ok in self.survival_trials if ok is None]
            after = f" after {open_n[0]} foreign prompts" if open_n else ""
            text = f"Survival is unverified: the server did not report a count for the check{after}"
            say(text + " (a missing count is never zero), so no survival number is given.")
        if self.survival is not None:
            few = self.survival <= 3
            advice = ": a loop that pauses while other jobs run needs `prefixreg keepalive`"
            say(f"A prefix survives {self.survival} foreign prompts{advice if few else ''}.")
        lagged = [c.lag for c in self.checks if c.lag and c.per_call == "fail" and not c.failed]
        if lags := sorted(set(lagged)):  # failed per call, passed over lagged windows
            late = " or ".join("one call" if lag == 1 else f"{lag} calls" for lag in lags)
            say(f"The /cache counters land {late} late: compare deltas over windows, not per call.")
        if self.checks and not self.has_cache:
            text = f"This server ({self.build.profile}) has no /cache counters: the six counter "
            text += "checks are not available; every verdict rests on each call's own "
            say(text + "cached_tokens.")
        if self.checks_unverified:
            text = "Every counter check is n/a although the server has /cache: no window could be "
            say(text + "compared, so the counters are unverified.")
        if interleaved := [c for c in self.calls if c.interleaved]:
            say(f"{len(interleaved)} windows were interleaved with foreign traffic, not counted.")
        return out

    def to_dict(self, *, public: bool = False) -> JSONObject:
        opts, state = self.options, judge_survival(self.survival_searched, self.survival)
        out: JSONObject = {
            "run_id": self.run_id,
            "at": self.at,
            "build": self.build.to_dict(public=public),
            "options": {
                **{
                    k: getattr(opts, k)
                    for k in ("foreign", "foreign_chars", "survival", "legs", "bisect")
                },
                "sizes": list(opts.sizes),
                "corpus": "builtin" if opts.corpus is None else "file",
                "frame": None if opts.frame is None else opts.frame.sha256,
            },
            "cmax": self.cmax,
            "cmax_below": self.cmax_below,
            "alignment": self.alignment,
            "survival": self.survival,
            "survival_state": state,
            "leg_seconds": {
                leg: {str(size): secs for size, secs in by_size.items()}
                for leg, by_size in self.leg_seconds().items()
            },
            "stores_per_prompt": self.stores_per_prompt,
            "survival_trials": [{"foreign": n, "survived": ok} for n, ok in self.survival_trials],
            "calls_made": len(self.calls),
            "checks": [asdict(c) for c in self.checks],
            "checks_not_available": [c.number for c in self.checks if c.per_call == "n/a"],
            "follows": list(self.follows()),
            "outcome": self.outcome,
            "qualify": self.qualify,
            "calls": [c.to_dict() for c in self.calls],
            "json_path": None if public else self.json_path,
            "md_path": None if public else self.md_path,
        }
        return out if public else {**out, "worker": self.worker}

    def to_markdown(self) -> str:
        opts, seconds, align = self.options, self.leg_seconds(), self.alignment
        c_only = "" if opts.legs == "all" else f" at {_sizes(self.legs('C'))} only"
        lines = [
            f"# Probe {self.run_id}\n",
            f"- when: {self.at}",
            f"- worker: {self.worker} ({self.build.profile}, build `{self.build.build_id}`)",
            f"- sizes: {', '.join(f'{s:,}' for s in opts.sizes)} characters; leg C after "
            f"{opts.foreign} foreign prompts{c_only}; {len(self.calls)} calls",
        ]
        if opts.frame is not None:
            text = f"- frame: `{opts.frame.sha256[:16]}`: each prefix sent with its tools and "
            lines.append(text + "settings, legs judged against the whole head")
        if self.qualify is not None:
            lines.append(f"- qualify: {self.qualify}")
        legs = "| size | leg | answers | prompt | cached | state | result | seconds |"
        lines += [f"\n## Legs\n\n{legs}", "|---:|---|---|---:|---:|---|---|---:|"]
        for c in (c for c in self.calls if c.leg in ANSWERS):
            ev = c.record.evidence
            row = f"| {c.size:,} | {c.leg} | {ANSWERS[c.leg]} | {_n(ev.prompt_tokens)} | "
            row += f"{_n(ev.cached_tokens)} | {ev.cache_state} | {_result(c, align)} | "
            lines.append(row + f"{_s(ev.wall_s)} |")
        sizes = sorted({s for by_size in seconds.values() for s in by_size})
        head = " | ".join(f"{s:,}" for s in sizes)
        lines += [f"\n## Seconds per leg\n\n| leg | {head} |", "|---|" + "---:|" * len(sizes)]
        for leg, by_size in seconds.items():
            cells = " | ".join(_s(by_size[s]) if s in by_size else "" for s in sizes)
            lines.append(f"| {leg} | {cells} |")
        lines.append("\n## Capacity and survival\n")
        below = "" if self.cmax_below is None else f", below {self.cmax_below:,}"
        lines.append(f"- Cmax (largest B): {_n(self.cmax)} tokens{below}{self._aligned()}")
        if self.survival_searched:
            marks = {True: "✓", False: "✗", None: "?"}
            trials = ", ".join(f"{n}{marks[ok]}" for n, ok in self.survival_trials)
            found = "unverified" if self.survival is None else f"{self.survival} foreign prompts"
            lines.append(f"- survival: {found} (trials: {trials or 'none'})")
        lines.append("\n## Counter checks\n\n| # | check | per call | windowed | detail |")
        lines.append("|---:|---|---|---|---|")
        for ch in self.checks:
            windowed = ch.windowed + (f" (lag {ch.lag})" if ch.lag else "")
            lines.append(f"| {ch.number} | {ch.title} | {ch.per_call} | {windowed} | {ch.detail} |")
        lines.append("\n## What follows\n")
        lines += [f"- {line}" for line in self.follows()] or ["- nothing unusual"]
        return "\n".join([*lines, "", f"Outcome: {self.outcome}.", ""])


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _sizes(calls: list[ProbeCall]) -> str:
    return ", ".join(f"{c.size:,}" for c in calls if c.size is not None) or "no size"


def _result(c: ProbeCall, alignment: int) -> str:
    """A leg's verdict in the table: its coverage when partial, the alignment when it let pass."""
    j = c.judgement
    if j is None:
        return "-"
    if j.verdict == "partial" and j.coverage is not None:
        return f"partial ({j.coverage:.0%} covered)"
    aligned = alignment_shaped(j)
    return f"resumed (within the {alignment:,}-token alignment)" if aligned else j.verdict


@dataclass(frozen=True, slots=True)
class DemoRun:
    """What `run_demo` did: the registry it used, the warm (with its check), the probe."""

    root: Path
    warm: WarmResult
    probe: ProbeReport

    @property
    def outcome(self) -> str:
        """The worse of the two: `unverified` when either is; else a warm that missed
        (`partial`, `cold`); else the probe's (`ok`, `check_failed`)."""
        if "unverified" in (self.warm.verdict, self.probe.outcome):
            return "unverified"
        return self.warm.verdict if self.warm.verdict in ("partial", "cold") else self.probe.outcome

    def receipt(self) -> JSONObject:
        return {
            "registry": str(self.root),
            "warm": self.warm.receipt(),
            "probe": self.probe.to_dict(),
        }

"""A probe run's data and its reading: `ProbeOptions`, `ProbeCall`, `ProbeReport`. Pure.

`ProbeReport` holds every call a probe made (leg, size, evidence, `/cache` snapshots), the
six counter checks and the survival search, and renders them: `to_dict` (the JSON receipt,
`--json`), `to_markdown` (the verdict a person reads) and `follows` (what the numbers mean).

Invariants:
- Every number shown is a server-reported count or a wall time the client measured; a value
  the server did not report is shown as `-` or said to be unverified, never as zero.
- `outcome` is `ok` only when something was verified: a leg that answers a question lacks
  counts, a survival trial whose count was unverified, or a run whose checks are all `n/a`
  on a server that has `/cache` makes it `unverified`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.judge import Verdict
from prefixreg.core.records import ServerBuild
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.probe.checks import CheckResult, Window

__all__ = [
    "DEFAULT_SIZES",
    "Outcome",
    "ProbeCall",
    "ProbeOptions",
    "ProbeReport",
]

DEFAULT_SIZES: Final = (4000, 16000, 32000, 64000)
Outcome = Literal["ok", "check_failed", "unverified"]
Legs = Literal["all", "report"]
LEG_ORDER: Final = ("A1", "A2", "B", "C")


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to probe: sizes in characters, foreign prompts for leg C, survival search."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    foreign: int = 9
    foreign_chars: int = 2000
    corpus: str | None = None
    survival: bool = False
    force: bool = False
    legs: Legs = "all"  # report: leg C at the size nearest 16k only (the report's 22 calls)
    # A verified frame: each size's prefix is sent with its tools and settings, and legs are
    # judged against that whole head (the slice plus the tools it renders).
    frame: Frame | None = None


@dataclass(frozen=True, slots=True)
class ProbeCall:
    """One call the probe made: which leg, which size, what was sent (by hash) and seen."""

    leg: str
    size: int | None
    sha256: str
    record: CallRecord
    verdict: Verdict | None = None
    span_tokens: int | None = None
    coverage: float | None = None

    def window(self) -> Window:
        r = self.record
        return Window(self.leg, self.size, r.evidence, r.before, r.after)

    def to_dict(self) -> JSONObject:
        return {
            "leg": self.leg,
            "size": self.size,
            "sha256": self.sha256,
            "verdict": self.verdict,
            "span_tokens": self.span_tokens,
            "coverage": self.coverage,
            **self.record.to_dict(),
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

    def legs(self, leg: str) -> list[ProbeCall]:
        return [c for c in self.calls if c.leg == leg]

    @property
    def cmax(self) -> int | None:
        """The largest cached count a fresh-tail call (B) was served: the measured Cmax."""
        values = [c.record.evidence.cached_tokens for c in self.legs("B")]
        valid = [v for v in values if v is not None]
        return max(valid) if valid else None

    @property
    def stores_per_prompt(self) -> int | None:
        """Entries one foreign prompt stores, read from the counters (median; None: no /cache)."""
        deltas = sorted(
            d
            for c in self.legs("foreign")
            if not c.record.interleaved and (d := c.window().delta("stores")) is not None
        )
        return deltas[len(deltas) // 2] if deltas else None

    @property
    def unverified(self) -> list[ProbeCall]:
        return [
            c
            for c in self.calls
            if c.leg != "foreign" and c.record.evidence.cache_state == "unverified"
        ]

    @property
    def interleaved(self) -> list[ProbeCall]:
        return [c for c in self.calls if c.record.interleaved]

    @property
    def survival_unverified(self) -> bool:
        """The survival search ran but a trial's answer was unverified: no number."""
        return self.survival_searched and self.survival is None

    @property
    def checks_unverified(self) -> bool:
        """Every counter check is n/a on a server that has `/cache`: nothing was compared."""
        has_cache = self.build.profile == "halogen" or any(
            c.record.before is not None for c in self.calls
        )
        return has_cache and bool(self.checks) and all(c.per_call == "n/a" for c in self.checks)

    def leg_seconds(self) -> dict[str, dict[int, float | None]]:
        """Wall seconds of each answering leg, by size: the report's per-leg timings."""
        out: dict[str, dict[int, float | None]] = {}
        for leg in LEG_ORDER:
            for c in self.legs(leg):
                if c.size is not None:
                    out.setdefault(leg, {})[c.size] = c.record.evidence.wall_s
        return out

    @property
    def outcome(self) -> Outcome:
        """`unverified` when a leg that answers a question (A2, B, C, survival) lacks the
        server's counts, or the counter checks compared nothing on a server with `/cache`;
        `check_failed` when a check failed beyond the lag explanation."""
        if any(c.leg != "A1" for c in self.unverified):
            return "unverified"
        if self.survival_unverified or self.checks_unverified:
            return "unverified"
        return "check_failed" if any(c.failed for c in self.checks) else "ok"

    def follows(self) -> list[str]:
        """What the numbers mean for prefix caching on this server, in plain words."""
        out: list[str] = []
        short = [c for c in self.legs("B") if c.verdict == "partial"]
        missing = [c for c in self.legs("B") if c.verdict in ("cold", "unverified")]
        if self.cmax is not None and short:
            sizes = ", ".join(f"{c.size:,}" for c in short)
            out.append(
                f"Cmax {self.cmax:,} is below the prefix sizes in use ({sizes} characters resumed "
                "only in part): on this server the design does not reach past the part of a "
                "prefix one entry holds."
            )
        if missing:
            sizes = ", ".join(f"{c.size:,} ({c.verdict})" for c in missing)
            below = all(
                (p := c.record.evidence.prompt_tokens) is not None and p < self.alignment
                for c in missing
            )
            why = (
                f"each prompt is shorter than the {self.alignment}-token alignment"
                if below and self.alignment > 1
                else "the server reported no reuse"
            )
            out.append(f"A fresh tail did not resume {sizes} characters: {why}.")
        if self.cmax is not None and not short and not missing:
            out.append(
                "Every size resumed whole from a fresh tail; "
                f"Cmax is at least {self.cmax:,} tokens."
            )
        shared = [
            c
            for c in self.legs("A1")
            if c.record.evidence.cache_state == "reused" and (c.coverage or 0.0) < 0.5
        ]
        if shared:
            most = max(c.record.evidence.cached_tokens or 0 for c in shared)
            out.append(
                f"{len(shared)} cold baselines reused up to {most:,} leading tokens shared with "
                "earlier prompts (the chat template, the probe's header), not the prefix: "
                "judged by coverage, they are cold."
            )
        warm_a1 = [c for c in self.legs("A1") if (c.coverage or 0.0) >= 0.5]
        if warm_a1:
            sizes = ", ".join(f"{c.size:,}" for c in warm_a1)
            out.append(
                f"The cold baseline at {sizes} characters was served mostly from cache: it is "
                "no cold baseline, and A1 vs B timings there mean nothing."
            )
        unproven = [c for c in self.legs("A1") if c.record.evidence.cache_state == "unverified"]
        if unproven:
            out.append(
                f"{len(unproven)} cold baselines are unverified: this server omits cached_tokens "
                "when nothing was cached and sends no timings.cache_n, so a cold call cannot be "
                "proven cold (a missing count is never zero)."
            )
        if self.alignment > 1:
            out.append(
                f"Cached counts are multiples of {self.alignment}: prompts under "
                f"{self.alignment} tokens never resume."
            )
        if self.survival_unverified:
            open_trials = [n for n, ok in self.survival_trials if ok is None]
            after = f" after {open_trials[0]} foreign prompts" if open_trials else ""
            out.append(
                f"Survival is unverified: the server did not report a count for the check{after} "
                "(a missing count is never zero), so no survival number is given."
            )
        if self.survival is not None:
            if self.survival <= 3:
                out.append(
                    f"A prefix survives {self.survival} foreign prompts: a loop that pauses "
                    "while other jobs run needs `prefixreg keepalive`."
                )
            else:
                out.append(f"A prefix survives {self.survival} foreign prompts.")
        lagged = sorted(
            {c.lag for c in self.checks if c.lag and c.windowed == "pass" and c.per_call == "fail"}
        )
        if lagged:
            out.append(
                "The /cache counters land "
                + " or ".join("one call" if lag == 1 else f"{lag} calls" for lag in lagged)
                + " late: compare deltas over windows, not per call."
            )
        if (
            self.checks
            and all(c.per_call == "n/a" for c in self.checks)
            and not any(c.record.before is not None for c in self.calls)
        ):
            out.append(
                f"This server ({self.build.profile}) has no /cache counters: the six counter "
                "checks are not available; every verdict rests on each call's own cached_tokens."
            )
        fixed = [c for c in self.checks if c.number == 5 and "fixed entry size" in c.detail]
        if fixed:
            out.append("Entries have a fixed size: only cached_tokens can answer capacity.")
        if self.checks_unverified:
            out.append(
                "Every counter check is n/a although the server has /cache: no window could be "
                "compared, so the counters are unverified."
            )
        if self.interleaved:
            out.append(
                f"{len(self.interleaved)} windows were interleaved with foreign traffic and not "
                "counted by the checks."
            )
        return out

    def to_dict(self, *, public: bool = False) -> JSONObject:
        opts = self.options
        out: dict[str, JSONValue] = {
            "run_id": self.run_id,
            "at": self.at,
            "build": self.build.to_dict(public=public),
            "options": {
                "sizes": list(opts.sizes),
                "foreign": opts.foreign,
                "foreign_chars": opts.foreign_chars,
                "corpus": "builtin" if opts.corpus is None else "file",
                "survival": opts.survival,
                "legs": opts.legs,
                "frame": None if opts.frame is None else opts.frame.sha256,
            },
            "cmax": self.cmax,
            "alignment": self.alignment,
            "survival": self.survival,
            "survival_state": (
                None
                if not self.survival_searched
                else ("unverified" if self.survival is None else "verified")
            ),
            "leg_seconds": {
                leg: {str(size): secs for size, secs in by_size.items()}
                for leg, by_size in self.leg_seconds().items()
            },
            "stores_per_prompt": self.stores_per_prompt,
            "survival_trials": [{"foreign": n, "survived": ok} for n, ok in self.survival_trials],
            "calls_made": len(self.calls),
            "checks": [c.to_dict() for c in self.checks],
            "checks_not_available": [c.number for c in self.checks if c.per_call == "n/a"],
            "follows": list(self.follows()),
            "outcome": self.outcome,
            "calls": [c.to_dict() for c in self.calls],
            "json_path": None if public else self.json_path,
            "md_path": None if public else self.md_path,
        }
        if not public:
            out["worker"] = self.worker
        return out

    def to_markdown(self) -> str:
        lines = [
            f"# Probe {self.run_id}",
            "",
            f"- when: {self.at}",
            f"- worker: {self.worker} ({self.build.profile}, build `{self.build.build_id}`)",
            f"- sizes: {', '.join(f'{s:,}' for s in self.options.sizes)} characters; "
            f"leg C after {self.options.foreign} foreign prompts"
            + ("" if self.options.legs == "all" else f" at {_sizes(self.legs('C'))} only")
            + f"; {len(self.calls)} calls",
            *(
                []
                if self.options.frame is None
                else [
                    f"- frame: `{self.options.frame.sha256[:16]}`: each prefix sent with its "
                    "tools and settings, legs judged against the whole head"
                ]
            ),
            "",
            "## Legs",
            "",
            "| size | leg | answers | prompt | cached | state | result | seconds |",
            "|---:|---|---|---:|---:|---|---|---:|",
        ]
        answers = {
            "A1": "cold baseline",
            "A2": "positions one entry holds",
            "B": "what a fresh call resumes",
            "C": "does the prefix survive the LRU?",
        }
        for c in self.calls:
            if c.leg not in answers:
                continue
            ev = c.record.evidence
            result: str = c.verdict or "-"
            if c.leg == "A1" and ev.cache_state == "reused" and c.coverage is not None:
                result = f"{'cold' if c.coverage < 0.5 else 'not cold'} ({c.coverage:.0%} covered)"
            lines.append(
                f"| {c.size:,} | {c.leg} | {answers[c.leg]} | {_n(ev.prompt_tokens)} | "
                f"{_n(ev.cached_tokens)} | {ev.cache_state} | {result} | {_s(ev.wall_s)} |"
            )
        seconds = self.leg_seconds()
        sizes = sorted({s for by_size in seconds.values() for s in by_size})
        lines += ["", "## Seconds per leg", "", "| leg | " + " | ".join(f"{s:,}" for s in sizes)]
        lines[-1] += " |"
        lines.append("|---|" + "---:|" * len(sizes))
        for leg, by_size in seconds.items():
            cells = " | ".join(_s(by_size[s]) if s in by_size else "" for s in sizes)
            lines.append(f"| {leg} | {cells} |")
        lines += ["", "## Capacity and survival", ""]
        lines.append(f"- Cmax (largest B): {_n(self.cmax)} tokens")
        if self.survival_searched:
            marks = {True: "✓", False: "✗", None: "?"}
            trials = ", ".join(f"{n}{marks[ok]}" for n, ok in self.survival_trials)
            found = "unverified" if self.survival is None else f"{self.survival} foreign prompts"
            lines.append(f"- survival: {found} (trials: {trials or 'none'})")
        lines += ["", "## Counter checks", "", "| # | check | per call | windowed | detail |"]
        lines.append("|---:|---|---|---|---|")
        for ch in self.checks:
            windowed = ch.windowed + (f" (lag {ch.lag})" if ch.lag else "")
            lines.append(f"| {ch.number} | {ch.title} | {ch.per_call} | {windowed} | {ch.detail} |")
        lines += ["", "## What follows", ""]
        lines += [f"- {line}" for line in self.follows()] or ["- nothing unusual"]
        lines += ["", f"Outcome: {self.outcome}.", ""]
        return "\n".join(lines)


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _sizes(calls: list[ProbeCall]) -> str:
    return ", ".join(f"{c.size:,}" for c in calls if c.size is not None) or "no size"

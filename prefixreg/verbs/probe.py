"""`probe`: measure a worker's prompt cache with calls: Cmax, LRU survival, counter checks.

For each size (characters of prefix text, sliced from a corpus and registered like any
prefix, with a per-run header so no leg can resume an earlier run's snapshot):

- A1 cold baseline; A2 identical repeat (the positions one entry holds);
- B same system bytes, fresh tail (what a fresh call resumes; Cmax is the largest B);
- C after `foreign` distinct foreign prompts, B again (does the prefix survive the LRU?).

`survival=True` then finds the largest number of foreign prompts a prefix survives, by a
binary search between a count known to survive and one known to evict, reusing C's answer
as the first bound so the search makes as few calls as it can.

On llama.cpp (no `/cache`) the same legs run on per-call evidence alone; the six counter
checks are `n/a` and the receipt says so. llama.cpp reuses any common prefix, even the
chat template's first tokens, so a "cold" A1 may report a few cached tokens: it is judged
by how much of the prefix those tokens cover, like every other leg (DESIGN §4). Its slot
choice also follows prompt similarity, so each foreign prompt starts with its own nonce:
sharing a header with the previous foreign prompt would steer it into that prompt's slot
and make the prefix look longer-lived than under real foreign traffic.

Every call is bracketed by `/cache` snapshots (on servers that have `/cache`); each leg is
written as a measurement bound to the server build, and the whole run as
`probes/<ts>.json` (every call's evidence and snapshots) and `probes/<ts>.md` (a verdict a
person reads). The probe holds the registry's `probe` lock, so two probes from one registry
never overlap, and refuses to start while the worker reports work in flight unless forced.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject, JSONValue, dumps_pretty
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.registry.store import Registry, iso_utc, stamp_utc, utc_now
from prefixreg.server.worker import Worker
from prefixreg.verbs.corpus import builtin_corpus, probe_slice
from prefixreg.verbs.probe_checks import CheckResult, Window, run_checks
from prefixreg.verbs.warm import (
    CallRecord,
    Verdict,
    judge_resume,
    measured_call,
    record_measurement,
)

__all__ = [
    "DEFAULT_SIZES",
    "Outcome",
    "ProbeCall",
    "ProbeOptions",
    "ProbeReport",
    "parse_sizes",
    "run_probe",
]

DEFAULT_SIZES: Final = (4000, 16000, 32000, 64000)
SURVIVAL_CAP: Final = 64
Progress = Callable[[str, int], None]
Outcome = Literal["ok", "check_failed", "unverified"]


def parse_sizes(text: str) -> tuple[int, ...]:
    """`4k,16k,32k` -> (4000, 16000, 32000): characters of prefix text, k = 1000."""
    sizes = []
    for part in text.split(","):
        item = part.strip().lower()
        mult = 1000 if item.endswith("k") else 1
        digits = item.removesuffix("k")
        if not digits.isdigit() or int(digits) * mult < 1:
            raise UsageError(f"bad size {part.strip()!r}: use characters like 4000 or 4k")
        sizes.append(int(digits) * mult)
    if not sizes:
        raise UsageError("no sizes given")
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True, slots=True)
class ProbeOptions:
    """What to probe: sizes in characters, foreign prompts for leg C, survival search."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    foreign: int = 9
    foreign_chars: int = 2000
    corpus: str | None = None
    survival: bool = False
    force: bool = False


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
    survival_trials: list[tuple[int, bool]] = field(default_factory=list)
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
    def outcome(self) -> Outcome:
        """`unverified` when a leg that answers a question (A2, B, C, survival) lacks the
        server's counts; `check_failed` when a check failed beyond the lag explanation."""
        if any(c.leg != "A1" for c in self.unverified):
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
            "build": self.build.to_dict(),
            "options": {
                "sizes": list(opts.sizes),
                "foreign": opts.foreign,
                "foreign_chars": opts.foreign_chars,
                "corpus": "builtin" if opts.corpus is None else "file",
                "survival": opts.survival,
            },
            "cmax": self.cmax,
            "alignment": self.alignment,
            "survival": self.survival,
            "stores_per_prompt": self.stores_per_prompt,
            "survival_trials": [{"foreign": n, "survived": ok} for n, ok in self.survival_trials],
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
            f"leg C after {self.options.foreign} foreign prompts",
            "",
            "## Legs",
            "",
            "| size | leg | answers | prompt | cached | state | result |",
            "|---:|---|---|---:|---:|---|---|",
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
                f"{_n(ev.cached_tokens)} | {ev.cache_state} | {result} |"
            )
        lines += ["", "## Capacity and survival", ""]
        lines.append(f"- Cmax (largest B): {_n(self.cmax)} tokens")
        if self.survival is not None:
            trials = ", ".join(f"{n}{'✓' if ok else '✗'}" for n, ok in self.survival_trials)
            lines.append(f"- survival: {self.survival} foreign prompts (trials: {trials})")
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


class _Prober:
    """The mutable state of one run: the worker, the last `/cache` snapshot, the calls."""

    def __init__(
        self, registry: Registry, worker: Worker, report: ProbeReport, progress: Progress
    ) -> None:
        self.registry = registry
        self.worker = worker
        self.report = report
        self.progress = progress
        self.with_cache = report.build.profile == "halogen"
        self.last = worker.cache() if self.with_cache else None
        corpus = report.options.corpus
        need = max(report.options.sizes) + report.options.foreign_chars
        self.corpus = corpus if corpus is not None else builtin_corpus(need)
        self.foreign_count = 0

    def call(self, leg: str, size: int | None, prefix: Prefix, tail: str) -> ProbeCall:
        self.progress(f"{leg} {size:,} chars" if size else leg, 1)
        record = measured_call(
            self.worker,
            prefix,
            phase=leg,
            tail=tail,
            with_cache=self.with_cache,
            before=self.last,
        )
        self.last = record.after
        verdict = span = coverage = None
        if leg in ("A1", "B", "C", "S-check"):
            judged, _, span, coverage = judge_resume(
                record.evidence,
                prefix_bytes=prefix.size,
                tail_bytes=len(tail.encode("utf-8")),
                alignment=self.report.alignment,
            )
            # A1 answers "how long is a cold call", not "did it resume": it keeps no verdict,
            # only its coverage (a few shared template tokens are not a warm baseline).
            verdict = None if leg == "A1" else judged
        call = ProbeCall(leg, size, prefix.sha256, record, verdict, span, coverage)
        self.report.calls.append(call)
        return call

    def foreign_chars(self) -> int:
        """Foreign prompt size: the option, but on an aligned server (dense) large enough to
        store a snapshot (2 x alignment tokens, by the chars per token the A1 legs measured);
        a smaller prompt stores nothing there and could not evict anything."""
        chars = self.report.options.foreign_chars
        align = self.report.alignment
        if align > 1:
            for c in self.report.legs("A1"):
                tokens = c.record.evidence.prompt_tokens
                if c.size and tokens:
                    chars = max(chars, math.ceil(2 * align * c.size / tokens))
                    break
        return chars

    def foreign(self, n: int) -> None:
        chars = self.foreign_chars()
        for _ in range(n):
            self.foreign_count += 1
            # The nonce comes first: no two foreign prompts share more than the chat
            # template's first tokens, so llama.cpp's similarity-based slot choice cannot
            # herd them into one slot (real foreign tenants do not share a header).
            seed = f"{self.report.run_id}/{self.foreign_count}".encode()
            nonce = hashlib.sha256(seed).hexdigest()[:12]
            header = (
                f"{nonce} foreign prompt {self.foreign_count} of prefixreg probe "
                f"{self.report.run_id}"
            )
            offset = (self.foreign_count * 7919) % len(self.corpus)
            text = probe_slice(self.corpus, chars, header=header, offset=offset)
            sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
            self.call("foreign", None, Prefix.from_text(sha, text), fresh_tail())

    def record_leg(self, call: ProbeCall) -> None:
        ev = call.record.evidence
        body: JSONObject = {
            "probe": self.report.run_id,
            "leg": call.leg,
            "size_chars": call.size,
            "verdict": call.verdict or ev.cache_state,
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "span_tokens": call.span_tokens,
            "calls": [call.record.to_dict()],
        }
        record_measurement(
            self.registry, self.worker, self.report.build, call.sha256, f"probe-{call.leg}", body
        )

    def legs(self, size: int) -> Prefix:
        header = f"prefixreg probe {self.report.run_id} prefix of {size} characters"
        text = probe_slice(self.corpus, size, header=header)
        sha = self.registry.add(text, note=f"probe {self.report.run_id}", source="probe")
        prefix = self.registry.get(sha)
        tail = fresh_tail()
        for leg, leg_tail in (("A1", tail), ("A2", tail), ("B", fresh_tail())):
            self.record_leg(self.call(leg, size, prefix, leg_tail))
        self.foreign(self.report.options.foreign)
        self.record_leg(self.call("C", size, prefix, fresh_tail()))
        return prefix

    def trial(self, prefix: Prefix, n: int) -> bool:
        self.foreign(n)
        check = self.call("S-check", None, prefix, fresh_tail())
        survived = check.verdict == "resumed"
        self.report.survival_trials.append((n, survived))
        return survived

    def survival(self, prefix: Prefix, c_survived: bool | None) -> int:
        """Largest n such that the prefix survives n foreign prompts (binary search)."""
        foreign = self.report.options.foreign
        self.call("S-warm", None, prefix, fresh_tail())  # make it the most recent entry
        lo, hi = 0, None
        if c_survived is True:
            lo = foreign
        elif c_survived is False:
            hi = foreign
        while hi is None:  # gallop upward until an eviction bounds the search
            n = max(1, lo * 2)
            if n > SURVIVAL_CAP:
                return lo
            if self.trial(prefix, n):
                lo = n
            else:
                hi = n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.trial(prefix, mid):
                lo = mid
            else:
                hi = mid
        return lo


def _alignment(build: ServerBuild) -> int:
    block = build.identity.get("prompt_cache")
    value = strict_count(block.get("snapshot_align")) if isinstance(block, dict) else None
    return value or 0


def _refuse_if_busy(worker: Worker, build: ServerBuild) -> None:
    if build.profile == "llamacpp":
        slots = worker.slots() or []  # llama.cpp's /slots may be off: nothing to go on
        in_flight, queued = sum(1 for s in slots if s.get("is_processing") is True), 0
    elif build.profile == "halogen":
        health = worker.health()
        in_flight = strict_count(health.get("in_flight")) or 0
        queued = strict_count(health.get("queued")) or 0
    else:
        return
    if in_flight or queued:
        raise UsageError(
            f"the worker reports {in_flight} requests in flight and {queued} queued: "
            "a probe now would measure someone else's traffic",
            hint="wait until it is idle, or pass --force",
        )


def run_probe(
    registry: Registry,
    worker: Worker,
    options: ProbeOptions,
    *,
    progress: Progress | None = None,
) -> ProbeReport:
    """Run every leg for every size (and the survival search), check, and write the receipt.

    Raises:
        UsageError: bad options, or the worker is busy (without `force`).
        LockTimeoutError: another probe from this registry is running.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    if options.foreign < 1:
        raise UsageError("--foreign must be at least 1")
    if options.corpus is not None and len(options.corpus) < max(options.sizes):
        raise UsageError(
            f"the corpus has {len(options.corpus):,} characters; the largest size needs "
            f"{max(options.sizes):,}"
        )
    registry.refuse_on_mirror("register probe prefixes")
    say = progress or (lambda _label, _n: None)
    with registry.lock("probe"):
        build = worker.server_build()
        if not options.force:
            _refuse_if_busy(worker, build)
        now = utc_now()
        report = ProbeReport(
            run_id=secrets.token_hex(4),
            at=iso_utc(now),
            worker=worker.url,
            build=build,
            options=options,
            alignment=_alignment(build),
        )
        prober = _Prober(registry, worker, report, say)
        prefixes = {size: prober.legs(size) for size in options.sizes}
        # Survival is searched on the smallest prefix a fresh call resumes whole (on an
        # aligned server a short one never resumes, and could not tell survival apart).
        resumable = [c for c in report.legs("B") if c.verdict == "resumed" and c.size]
        if options.survival and resumable:
            size = min(c.size for c in resumable if c.size)
            c_leg = next(c for c in report.legs("C") if c.size == size)
            c_survived = (
                None if c_leg.verdict in (None, "unverified") else c_leg.verdict == "resumed"
            )
            report.survival = prober.survival(prefixes[size], c_survived)
        report.checks = run_checks([c.window() for c in report.calls], options.sizes)
        _write_receipt(registry, report, stamp_utc(now))
    return report


def _write_receipt(registry: Registry, report: ProbeReport, stamp: str) -> None:
    def render(json_path: Path, md_path: Path) -> tuple[bytes, bytes]:
        report.json_path, report.md_path = str(json_path), str(md_path)
        return dumps_pretty(report.to_dict()), report.to_markdown().encode("utf-8")

    registry.write_probe_receipt(stamp, render)

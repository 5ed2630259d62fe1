"""`probe`: measure a worker's prompt cache with calls: Cmax, LRU survival, counter checks.

For each size (characters of prefix text, sliced from a corpus with a per-run header so no
leg can resume an earlier run's snapshot, and registered as a probe slice, kept apart from
the user's prefixes):

- A1 cold baseline; A2 identical repeat (the positions one entry holds);
- B same system bytes, fresh tail (what a fresh call resumes; Cmax is the largest B);
- C after `foreign` distinct foreign prompts, B again (does the prefix survive the LRU?),
  at every size or, with `legs="report"`, at the size nearest 16k only.

`survival=True` then finds the largest number of foreign prompts a prefix survives, by a
binary search between a count known to survive and one known to evict (C's answer is the
first bound). A trial the server did not verify stops the search: survival is then
unverified, never a number.

Invariants:
- Every leg is judged by `prefixreg.core.judge.judge` against the head it sent (the slice,
  plus a frame's tools when it renders them), with the engine's alignment; the receipt and
  each leg's measurement carry the verdict and the reason.
- With a frame (`ProbeOptions.frame`, a verified `Frame`), each size's prefix is sent with
  its tools and settings byte for byte as `warm` of the frame sends them; foreign prompts
  stay bare. The frame's tools count toward the context check.
- On llama.cpp (no `/cache`) the legs run on per-call evidence alone (the counter checks are
  `n/a`); its slot choice follows prompt similarity, so each foreign prompt starts with its
  own nonce, or they would herd into one slot and flatter survival.
- Every call is bracketed by `/cache` snapshots where the server has them; each leg is a
  measurement bound to the server build, the run a receipt (`probes/<ts>.json` and `.md`).
  The registry's `probe` lock keeps two probes from one registry apart, and a worker that
  reports work in flight is refused unless forced.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Final

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject, dumps_pretty
from prefixreg.core.judge import judge
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.registry.store import Registry, iso_utc, stamp_utc, utc_now
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import measured_call, record_measurement
from prefixreg.verbs.probe.checks import run_checks
from prefixreg.verbs.probe.corpus import builtin_corpus, probe_slice
from prefixreg.verbs.probe.options import DEFAULT_SIZES, ProbeOptions, check_sizes, parse_sizes
from prefixreg.verbs.probe.report import ProbeCall, ProbeReport

# What callers import from here (the CLI, the demo, tests).
__all__ = [
    "DEFAULT_SIZES",
    "ProbeOptions",
    "ProbeReport",
    "check_sizes",
    "parse_sizes",
    "run_probe",
]

SURVIVAL_CAP: Final = 64
Progress = Callable[[str, int], None]


class _Prober:
    """The mutable state of one run: the worker, the last `/cache` snapshot, the calls."""

    def __init__(
        self, registry: Registry, worker: Worker, report: ProbeReport, progress: Progress
    ) -> None:
        self.registry, self.worker, self.report, self.progress = registry, worker, report, progress
        self.options = opts = report.options
        self.with_cache = report.build.profile == "halogen"
        self.last = worker.cache() if self.with_cache else None
        need = max(opts.sizes) + opts.foreign_chars
        self.corpus = opts.corpus if opts.corpus is not None else builtin_corpus(need)
        self.foreign_count = 0
        # The frame's tools and settings, sent with every leg but the foreign prompts.
        self.frame_params = opts.frame.head() if opts.frame is not None else {}

    def call(self, leg: str, size: int | None, prefix: Prefix, tail: str) -> ProbeCall:
        self.progress(f"{leg} {size:,} chars" if size else leg, 1)
        foreign = leg == "foreign"
        record = measured_call(
            self.worker,
            prefix,
            phase=leg,
            tail=tail,
            with_cache=self.with_cache,
            before=self.last,
            **({} if foreign else self.frame_params),
        )
        self.last = record.after
        judgement = None
        if not foreign:
            judgement = judge(
                record.evidence,
                head_bytes=prefix.size + self.options.head_extra,
                rest_bytes=len(tail.encode("utf-8")),
                alignment=self.report.alignment,
            )
        call = ProbeCall(leg, size, prefix.sha256, record, judgement)
        self.report.calls.append(call)
        return call

    def foreign(self, n: int) -> None:
        """`n` foreign prompts. On an aligned server (dense) each is large enough to store a
        snapshot (2 x alignment tokens, by the chars per token an A1 leg measured): a smaller
        prompt stores nothing there and could not evict anything."""
        chars, align = self.options.foreign_chars, self.report.alignment
        measured = [c for c in self.report.legs("A1") if c.record.evidence.prompt_tokens]
        if align > 1 and measured and measured[0].size:
            tokens = measured[0].record.evidence.prompt_tokens or 1
            chars = max(chars, math.ceil(2 * align * measured[0].size / tokens))
        for _ in range(n):
            self.foreign_count += 1
            # The nonce comes first: no two foreign prompts share more than the chat
            # template's first tokens (real foreign tenants do not share a header).
            seed = f"{self.report.run_id}/{self.foreign_count}".encode()
            nonce = hashlib.sha256(seed).hexdigest()[:12]
            run, count = self.report.run_id, self.foreign_count
            header = f"{nonce} foreign prompt {count} of prefixreg probe {run}"
            offset = (count * 7919) % len(self.corpus)
            text = probe_slice(self.corpus, chars, header=header, offset=offset)
            sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
            self.call("foreign", None, Prefix.from_text(sha, text), fresh_tail())

    def record_leg(self, call: ProbeCall) -> None:
        ev, judgement = call.record.evidence, call.judgement
        body: JSONObject = {
            "probe": self.report.run_id,
            "leg": call.leg,
            "size_chars": call.size,
            **({} if judgement is None else judgement.to_dict()),
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "calls": [call.record.to_dict()],
        }
        if self.options.frame is not None:
            body["frame"] = self.options.frame.sha256
        kind = f"probe-{call.leg}"
        record_measurement(self.registry, self.worker, self.report.build, call.sha256, kind, body)

    def legs(self, size: int) -> Prefix:
        header = f"prefixreg probe {self.report.run_id} prefix of {size} characters"
        text = probe_slice(self.corpus, size, header=header)
        prefix = self.registry.get(self.registry.add_probe_slice(text, run_id=self.report.run_id))
        tail = fresh_tail()
        for leg, leg_tail in (("A1", tail), ("A2", tail), ("B", fresh_tail())):
            self.record_leg(self.call(leg, size, prefix, leg_tail))
        if size in self.options.c_sizes:
            self.foreign(self.options.foreign)
            self.record_leg(self.call("C", size, prefix, fresh_tail()))
        return prefix

    def trial(self, prefix: Prefix, n: int) -> bool | None:
        """Did the prefix survive `n` foreign prompts? None: the server proved neither (a
        missing count is never zero, so an unverified check is no eviction)."""
        self.foreign(n)
        survived = _survived(self.call("S-check", None, prefix, fresh_tail()))
        self.report.survival_trials.append((n, survived))
        return survived

    def survival(self, prefix: Prefix, c_survived: bool | None) -> int | None:
        """Largest n such that the prefix survives n foreign prompts: gallop up until an
        eviction bounds the search, then bisect. None when a trial's answer was unverified:
        the search cannot place it, and a number built on it would be a guess."""
        self.call("S-warm", None, prefix, fresh_tail())  # make it the most recent entry
        foreign = self.options.foreign
        lo, hi = (foreign, None) if c_survived else (0, None if c_survived is None else foreign)
        while hi is None or hi - lo > 1:
            n = max(1, lo * 2) if hi is None else (lo + hi) // 2
            if hi is None and n > SURVIVAL_CAP:
                return lo
            got = self.trial(prefix, n)
            if got is None:
                return None
            lo, hi = (n, hi) if got else (lo, n)
        return lo


def _survived(call: ProbeCall | None) -> bool | None:
    """A check's answer to "did it survive?": the judge's resumed, else no; None when the
    judge could not say (or there was no check)."""
    if call is None or call.verdict in (None, "unverified"):
        return None
    return call.verdict == "resumed"


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
        UsageError: arguments of the wrong type, sizes the worker's context cannot hold, or
            the worker is busy (without `force`).
        LockTimeoutError: another probe from this registry is running.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    given: list[object] = [registry, worker, options, progress]
    if not (isinstance(given[0], Registry) and isinstance(given[1], Worker)):
        raise UsageError("run_probe takes a Registry and a Worker")
    if not isinstance(given[2], ProbeOptions):
        raise UsageError(f"options must be ProbeOptions, not {type(given[2]).__name__}")
    if given[3] is not None and not callable(given[3]):
        raise UsageError("progress must be a callable (label, calls) or None")
    registry.refuse_on_mirror("register probe prefixes")
    with registry.lock("probe"):
        build = worker.server_build()
        check_sizes(options, build)  # before the corpus (sized by them) is made
        if not options.force:
            _refuse_if_busy(worker, build)
        now = utc_now()
        report = ProbeReport(
            run_id=secrets.token_hex(4),
            at=iso_utc(now),
            worker=worker.url,
            build=build,
            options=options,
            alignment=build.snapshot_align,
        )
        prober = _Prober(registry, worker, report, progress or (lambda _label, _n: None))
        prefixes = {size: prober.legs(size) for size in options.sizes}
        # Survival is searched on the smallest size a fresh call resumed (on an aligned
        # server a short one never resumes, and could not tell survival apart).
        resumed = [c.size for c in report.legs("B") if c.verdict == "resumed" and c.size]
        if options.survival and resumed:
            size = min(resumed)
            c_leg = next((c for c in report.legs("C") if c.size == size), None)
            report.survival = prober.survival(prefixes[size], _survived(c_leg))
            report.survival_searched = True
        report.checks = run_checks([c.window() for c in report.calls], options.sizes)

        def render(json_path: Path, md_path: Path) -> tuple[bytes, bytes]:
            report.json_path, report.md_path = str(json_path), str(md_path)
            return dumps_pretty(report.to_dict()), report.to_markdown().encode("utf-8")

        registry.write_probe_receipt(stamp_utc(now), render)
    return report

"""`probe`: measure a worker's prompt cache with calls: Cmax, LRU survival, counter checks.

For each size (characters of prefix text, sliced from a corpus and registered as a probe
slice (`Registry.add_probe_slice`: kept apart from the user's prefixes), with a per-run
header so no leg can resume an earlier run's snapshot):

- A1 cold baseline; A2 identical repeat (the positions one entry holds);
- B same system bytes, fresh tail (what a fresh call resumes; Cmax is the largest B);
- C after `foreign` distinct foreign prompts, B again (does the prefix survive the LRU?);
  at every size, or with `legs="report"` at the size nearest 16k only (the report's shape:
  22 calls at the four default sizes).

`survival=True` then finds the largest number of foreign prompts a prefix survives, by a
binary search between a count known to survive and one known to evict, reusing C's answer
as the first bound so the search makes as few calls as it can. A trial whose check the
server did not verify stops the search: survival is then unverified, never a number.

Sizes are bounded twice before any text is made: at parse (`MAX_SIZE_CHARS`) and against
the worker's context once its build is read (`check_sizes`); both are usage errors. The
report (`ProbeReport`, in `probe_report`) reads the calls; this module makes them.

With a frame (`ProbeOptions.frame`), each size's prefix is sent with the frame's tools and
settings, byte for byte as `warm` of the frame sends them; a leg is judged against that whole
head (the slice plus the tools it renders), the tools count toward the context check, and
every leg's measurement and the receipt record the frame's sha. Foreign prompts stay bare.

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
from prefixreg.verbs.probe.report import (
    DEFAULT_SIZES,
    Outcome,
    ProbeCall,
    ProbeOptions,
    ProbeReport,
)
from prefixreg.verbs.probe.sizes import (
    MAX_SIZE_CHARS,
    c_sizes,
    check_sizes,
    context_tokens,
    head_extra,
    parse_sizes,
)

__all__ = [
    "DEFAULT_SIZES",
    "Outcome",
    "ProbeCall",
    "ProbeOptions",
    "ProbeReport",
    "c_sizes",
    "check_sizes",
    "context_tokens",
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
        frame = report.options.frame
        # The frame's tools and settings, sent with every leg but the foreign prompts.
        self.head = frame.head() if frame is not None else {}
        self.head_extra = head_extra(report.options)

    def call(self, leg: str, size: int | None, prefix: Prefix, tail: str) -> ProbeCall:
        self.progress(f"{leg} {size:,} chars" if size else leg, 1)
        record = measured_call(
            self.worker,
            prefix,
            phase=leg,
            tail=tail,
            with_cache=self.with_cache,
            before=self.last,
            **({} if leg == "foreign" else self.head),
        )
        self.last = record.after
        verdict = span = coverage = None
        if leg in ("A1", "B", "C", "S-check"):
            judgement = judge(
                record.evidence,
                head_bytes=prefix.size + self.head_extra,
                rest_bytes=len(tail.encode("utf-8")),
                alignment=self.report.alignment,
            )
            judged, span, coverage = judgement.verdict, judgement.span, judgement.coverage
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
        if self.report.options.frame is not None:
            body["frame"] = self.report.options.frame.sha256
        record_measurement(
            self.registry, self.worker, self.report.build, call.sha256, f"probe-{call.leg}", body
        )

    def legs(self, size: int) -> Prefix:
        header = f"prefixreg probe {self.report.run_id} prefix of {size} characters"
        text = probe_slice(self.corpus, size, header=header)
        sha = self.registry.add_probe_slice(text, run_id=self.report.run_id)
        prefix = self.registry.get(sha)
        tail = fresh_tail()
        for leg, leg_tail in (("A1", tail), ("A2", tail), ("B", fresh_tail())):
            self.record_leg(self.call(leg, size, prefix, leg_tail))
        if size in c_sizes(self.report.options):
            self.foreign(self.report.options.foreign)
            self.record_leg(self.call("C", size, prefix, fresh_tail()))
        return prefix

    def trial(self, prefix: Prefix, n: int) -> bool | None:
        """Did the prefix survive `n` foreign prompts? None: the server did not prove either
        (a missing count is never zero, so an unverified check is no eviction)."""
        self.foreign(n)
        check = self.call("S-check", None, prefix, fresh_tail())
        survived = None if check.verdict in (None, "unverified") else check.verdict == "resumed"
        self.report.survival_trials.append((n, survived))
        return survived

    def survival(self, prefix: Prefix, c_survived: bool | None) -> int | None:
        """Largest n such that the prefix survives n foreign prompts (binary search).

        None when a trial's answer was unverified: the search cannot place it, and a
        number built on it would be a guess."""
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
            got = self.trial(prefix, n)
            if got is None:
                return None
            if got:
                lo = n
            else:
                hi = n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = self.trial(prefix, mid)
            if got is None:
                return None
            if got:
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
    # The API boundary: options built without parse_sizes get the same bounds.
    if not options.sizes or any(
        type(n) is not int or not 1 <= n <= MAX_SIZE_CHARS
        for n in (*options.sizes, options.foreign_chars)
    ):
        raise UsageError(
            f"sizes and --foreign-chars must be whole numbers from 1 to {MAX_SIZE_CHARS:,}"
        )
    if options.corpus is not None and len(options.corpus) < max(options.sizes):
        raise UsageError(
            f"the corpus has {len(options.corpus):,} characters; the largest size needs "
            f"{max(options.sizes):,}"
        )
    if options.legs not in ("all", "report"):
        raise UsageError(f"--legs {options.legs!r}: use all or report")
    registry.refuse_on_mirror("register probe prefixes")
    say = progress or (lambda _label, _n: None)
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
            alignment=_alignment(build),
        )
        prober = _Prober(registry, worker, report, say)
        prefixes = {size: prober.legs(size) for size in options.sizes}
        # Survival is searched on the smallest prefix a fresh call resumes whole (on an
        # aligned server a short one never resumes, and could not tell survival apart).
        resumable = [c for c in report.legs("B") if c.verdict == "resumed" and c.size]
        if options.survival and resumable:
            size = min(c.size for c in resumable if c.size)
            c_leg = next((c for c in report.legs("C") if c.size == size), None)
            c_survived = (
                None
                if c_leg is None or c_leg.verdict in (None, "unverified")
                else c_leg.verdict == "resumed"
            )
            report.survival = prober.survival(prefixes[size], c_survived)
            report.survival_searched = True
        report.checks = run_checks([c.window() for c in report.calls], options.sizes)
        _write_receipt(registry, report, stamp_utc(now))
    return report


def _write_receipt(registry: Registry, report: ProbeReport, stamp: str) -> None:
    def render(json_path: Path, md_path: Path) -> tuple[bytes, bytes]:
        report.json_path, report.md_path = str(json_path), str(md_path)
        return dumps_pretty(report.to_dict()), report.to_markdown().encode("utf-8")

    registry.write_probe_receipt(stamp, render)

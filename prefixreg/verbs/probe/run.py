"""`probe`: measure a worker's prompt cache with calls: Cmax, LRU survival, counter checks.

Per size (characters of a probe slice: corpus text under a per-run header, so no leg can
resume an earlier run's snapshot): A1 cold baseline; A2 identical repeat (the positions one
entry holds); B same bytes, fresh tail (what a fresh call resumes; Cmax is the largest B);
C after `foreign` foreign prompts, B again (does the prefix survive the LRU?), at every size
or with `legs="report"` at the one nearest 16k. `survival=True` then searches the most
foreign prompts a prefix survives; a trial the server did not verify leaves it unverified.
`bisect=True` then narrows Cmax's bracket (at least the largest size a fresh tail resumed,
below the first larger one that did not): a new slice halfway, cold (`bisect-A1`) then a
fresh tail (`bisect-B`), until the bracket is within `BISECT_SHARE` of its bottom.

Invariants:
- Options are checked when built (`UsageError`), sizes against the worker's context (a
  frame's tools counted) before any text is made.
- Every leg is judged by `core.judge.judge` against the head it sent (the slice, plus the
  frame's tools when they render) with the engine's alignment; foreign prompts are bare.
- Each foreign prompt starts with its own nonce: llama.cpp's similarity-based slot choice
  would otherwise herd them into one slot and flatter survival.
- Each leg is a measurement bound to the server build, the run a receipt (`probes/<ts>.json`
  and `.md`), under the registry's `probe` lock; a busy worker is refused unless forced.

`run_demo` is `prefixreg demo`'s sequence ending in a short probe: add a prompt, warm it, probe.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, cast

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject, dumps_pretty
from prefixreg.core.judge import judge
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import ServerBuild, strict_count
from prefixreg.registry.store import Registry, iso_utc, stamp_utc, utc_now
from prefixreg.registry.userfiles import read_user_file
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import (
    latest_qualify,
    measured_call,
    qualify_note,
    record_measurement,
)
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.probe import notes
from prefixreg.verbs.probe.checks import ProbeCall, run_checks
from prefixreg.verbs.probe.options import (
    SURVIVAL_CAP,
    Legs,
    ProbeOptions,
    builtin_corpus,
    probe_slice,
)
from prefixreg.verbs.probe.options import check_sizes as check_sizes  # a verb's door
from prefixreg.verbs.probe.options import parse_sizes as parse_sizes
from prefixreg.verbs.probe.report import DemoRun
from prefixreg.verbs.probe.report import ProbeReport as ProbeReport  # the verb's result

Progress = Callable[[str, int], None]
Say = Callable[[str], None]
# Bisection stops when the bracket's sizes are this close (a share of its bottom, or chars).
BISECT_SHARE = 0.02
BISECT_MIN_CHARS = 200
BISECT_STEPS = 16


def probe_inputs(
    sizes: str, corpus: Path | None, *, public: bool, json_out: bool
) -> tuple[tuple[int, ...], str | None]:
    """`probe`'s option rules, its sizes and its corpus's text, before the registry is
    opened (UsageError)."""
    if public and not json_out:
        raise UsageError("--public shapes the --json receipt; add --json")
    parsed = parse_sizes(sizes)
    if corpus is None:
        return parsed, None
    try:
        return parsed, read_user_file(corpus).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{corpus}: the corpus is not UTF-8 text") from None


def probe_options(
    registry: Registry,
    sizes: tuple[int, ...],
    corpus: str | None,
    *,
    frame: str | None,
    legs: str,
    **fields: Any,
) -> ProbeOptions:
    """The `ProbeOptions` of a `probe` command: `frame` resolved and verified once, before
    any call (UsageError: it names a prefix, no tools to send); `fields` the others."""
    head = None if frame is None else registry.head(frame)
    if head is not None and not isinstance(head, Frame):
        raise UsageError(f"--frame {frame}: names a prefix, not a frame (no tools to send)")
    return ProbeOptions(sizes=sizes, corpus=corpus, frame=head, legs=cast(Legs, legs), **fields)


class _Prober:
    """The mutable state of one run: the worker, the last `/cache` snapshot, the calls."""

    def __init__(
        self,
        registry: Registry,
        worker: Worker,
        report: ProbeReport,
        progress: Progress,
        say: Say | None = None,
    ) -> None:
        self.registry, self.worker, self.report, self.progress = registry, worker, report, progress
        self.say, self.estimated, self.foreign_n, self.foreign_s = say, False, 0, 0.0
        self.options = opts = report.options
        self.with_cache = report.build.profile == "halogen"
        self.last = worker.cache() if self.with_cache else None
        need = max(opts.sizes) + opts.foreign_chars
        self.corpus = opts.corpus if opts.corpus is not None else builtin_corpus(need)
        self.foreign_count = 0
        # The frame's tools and settings go with every leg but the foreign prompts.
        self.frame_params = opts.frame.head() if opts.frame is not None else {}

    def call(self, leg: str, size: int | None, prefix: Prefix, tail: str) -> ProbeCall:
        self.progress(f"{leg} {size:,} chars" if size else leg, 1)
        bare, cache = leg == "foreign", self.with_cache
        params = {} if bare else self.frame_params
        record = measured_call(
            self.worker,
            prefix,
            build=self.report.build,
            phase=leg,
            tail=tail,
            with_cache=cache,
            before=self.last,
            **params,
        )
        self.last, judgement = record.after, None
        if not bare:
            head, rest = prefix.size + self.options.head_extra, len(tail.encode("utf-8"))
            align = self.report.alignment
            judgement = judge(record.evidence, head_bytes=head, rest_bytes=rest, alignment=align)
        call = ProbeCall(leg, size, prefix.sha256, record, judgement)
        self.report.calls.append(call)
        if self.say is not None:
            self.tell(self.say, call)
        return call

    def tell(self, say: Say, call: ProbeCall) -> None:
        """The leg's line (foreign prompts: one line a batch, said before the next leg), and
        after the first cold leg, the estimate of the rest."""
        if call.leg == "foreign":
            self.foreign_n, self.foreign_s = (
                self.foreign_n + 1,
                self.foreign_s + (call.record.evidence.wall_s or 0.0),
            )
            return
        if self.foreign_n:
            say(f"  {self.foreign_n} foreign prompts in {self.foreign_s:.2f} s")
            self.foreign_n, self.foreign_s = 0, 0.0
        say(notes.leg_line(call))
        if not self.estimated and call.verdict in ("cold", "partial") and call.leg == "A1":
            rate = notes.first_rate(call)
            if rate is not None:
                self.estimated = True
                seconds, line = notes.estimate(self.options, rate, len(self.report.calls))
                if seconds >= notes.ESTIMATE_FROM_S:
                    say(line)

    def foreign(self, n: int) -> None:
        """`n` foreign prompts. On an aligned server (dense) each is large enough to store a
        snapshot (2 x alignment tokens, by the chars per token an A1 leg measured): a smaller
        prompt stores nothing there and could not evict anything."""
        chars, align, run = self.options.foreign_chars, self.report.alignment, self.report.run_id
        measured = [c for c in self.report.legs("A1") if c.record.evidence.prompt_tokens]
        if align > 1 and measured and measured[0].size:
            tokens = measured[0].record.evidence.prompt_tokens or 1
            chars = max(chars, math.ceil(2 * align * measured[0].size / tokens))
        for _ in range(n):
            self.foreign_count += 1
            count = self.foreign_count
            # The nonce comes first: no two foreign prompts share more than the chat
            # template's first tokens (real foreign tenants do not share a header).
            nonce = hashlib.sha256(f"{run}/{count}".encode()).hexdigest()[:12]
            header = f"{nonce} foreign prompt {count} of prefixreg probe {run}"
            offset = (count * 7919) % len(self.corpus)
            text = probe_slice(self.corpus, chars, header=header, offset=offset)
            sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
            self.call("foreign", None, Prefix.from_text(sha, text), fresh_tail())

    def leg(self, leg: str, size: int, prefix: Prefix, tail: str) -> None:
        """One answering leg, written as a measurement bound to the build."""
        call = self.call(leg, size, prefix, tail)
        ev, judged = call.record.evidence, call.judgement.to_dict() if call.judgement else {}
        body: JSONObject = {"probe": self.report.run_id, "leg": leg, "size_chars": size, **judged}
        body |= {"prompt_tokens": ev.prompt_tokens, "cached_tokens": ev.cached_tokens}
        body["calls"] = [call.record.to_dict()]
        if self.options.frame is not None:
            body["frame"] = self.options.frame.sha256
        build = self.report.build
        record_measurement(self.registry, self.worker, build, prefix.sha256, f"probe-{leg}", body)

    def size(self, size: int) -> Prefix:
        header = f"prefixreg probe {self.report.run_id} prefix of {size} characters"
        text = probe_slice(self.corpus, size, header=header)
        prefix = self.registry.get(self.registry.add_probe_slice(text, run_id=self.report.run_id))
        tail = fresh_tail()
        for leg, leg_tail in (("A1", tail), ("A2", tail), ("B", fresh_tail())):
            self.leg(leg, size, prefix, leg_tail)
        if size in self.options.c_sizes:
            self.foreign(self.options.foreign)
            self.leg("C", size, prefix, fresh_tail())
        return prefix

    def bisect(self) -> None:
        """Narrow the bracket between the largest size whose fresh tail resumed and the first
        larger size that did not (partial or cold); an unverified leg ends the search."""
        for _ in range(BISECT_STEPS):
            lo, hi = self.report.size_bracket()
            if lo is None or hi is None or hi - lo <= max(BISECT_MIN_CHARS, lo * BISECT_SHARE):
                return
            size = (lo + hi) // 2
            header = f"prefixreg probe {self.report.run_id} prefix of {size} characters"
            text = probe_slice(self.corpus, size, header=header)
            prefix = self.registry.get(
                self.registry.add_probe_slice(text, run_id=self.report.run_id)
            )
            self.leg("bisect-A1", size, prefix, fresh_tail())
            self.leg("bisect-B", size, prefix, fresh_tail())
            if self.report.calls[-1].verdict in (None, "unverified"):
                return

    def survival(self, prefix: Prefix, c_survived: bool | None) -> int | None:
        """Largest n such that the prefix survives n foreign prompts: gallop up until an eviction
        bounds the search, then bisect; None when a trial was unverified (a number is a guess)."""
        self.call("S-warm", None, prefix, fresh_tail())  # make it the most recent entry
        foreign = self.options.foreign
        lo, hi = (foreign, None) if c_survived else (0, None if c_survived is None else foreign)
        while hi is None or hi - lo > 1:
            n = max(1, lo * 2) if hi is None else (lo + hi) // 2
            if hi is None and n > SURVIVAL_CAP:
                return lo
            self.foreign(n)
            survived = _survived(self.call("S-check", None, prefix, fresh_tail()))
            self.report.survival_trials.append((n, survived))
            if survived is None:
                return None
            lo, hi = (n, hi) if survived else (lo, n)
        return lo


def _survived(call: ProbeCall | None) -> bool | None:
    """The judge's resumed, else no; None when it could not say (unverified is no eviction)."""
    if call is None or call.verdict in (None, "unverified"):
        return None
    return call.verdict == "resumed"


def _refuse_if_busy(worker: Worker, build: ServerBuild) -> None:
    if build.profile == "llamacpp":
        slots = worker.slots() or []  # llama.cpp's /slots may be off: nothing to go on
        # Strict: a slot is idle only when `is_processing` is exactly false ("yes" is busy).
        in_flight, queued = sum(1 for s in slots if s.get("is_processing") is not False), 0
    elif build.profile == "halogen":
        health = worker.health()
        in_flight = strict_count(health.get("in_flight")) or 0
        queued = strict_count(health.get("queued")) or 0
    else:
        return
    if in_flight or queued:
        text = f"the worker reports {in_flight} requests in flight and {queued} queued: "
        hint = "wait until it is idle, or pass --force"
        raise UsageError(text + "a probe now would measure someone else's traffic", hint=hint)


def run_probe(
    registry: Registry,
    worker: Worker,
    options: ProbeOptions,
    *,
    progress: Progress | None = None,
    say: Say | None = None,
) -> ProbeReport:
    """Run every leg for every size (and the survival search), check, and write the receipt.
    `say` (the CLI's, on a terminal) is told the plan, a line per leg, and an estimate of a
    long run after its first cold leg (`notes`).

    Raises:
        UsageError: wrong argument types, sizes over the worker's context, or a busy worker.
        LockTimeoutError: another probe from this registry is running.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    given: list[object] = [registry, worker, options, progress]
    if not (isinstance(given[0], Registry) and isinstance(given[1], Worker)):
        raise UsageError("run_probe takes a Registry and a Worker")
    if not isinstance(given[2], ProbeOptions):
        raise UsageError(f"options must be ProbeOptions, not {type(given[2]).__name__}")
    if not (given[3] is None or callable(given[3])):
        raise UsageError("progress must be a callable (label, calls) or None")
    if not (say is None or callable(say)):
        raise UsageError("say must be a callable (line) or None")
    registry.refuse_on_mirror("register probe prefixes")
    with registry.lock("probe"):
        build = worker.server_build()
        check_sizes(options, build)  # before the corpus (sized by them) is made
        if not options.force:
            _refuse_if_busy(worker, build)
        now = utc_now()
        align = build.snapshot_align
        report = ProbeReport(
            secrets.token_hex(4), iso_utc(now), worker.url, build, options, alignment=align
        )
        if (qualified := latest_qualify(registry, build.build_id)) is not None:
            report.qualify = qualify_note(qualified)
        prober = _Prober(registry, worker, report, progress or (lambda _label, _n: None), say)
        if say is not None:
            say(notes.plan(options))
        prefixes = {size: prober.size(size) for size in options.sizes}
        # Survival is searched on the smallest size a fresh call resumed (on an aligned
        # server a short one never resumes, and could not tell survival apart).
        resumed = [c.size for c in report.legs("B") if c.verdict == "resumed" and c.size]
        if options.survival and resumed:
            c_leg = next((c for c in report.legs("C") if c.size == min(resumed)), None)
            report.survival = prober.survival(prefixes[min(resumed)], _survived(c_leg))
            report.survival_searched = True
        if options.bisect:
            prober.bisect()
        report.checks = run_checks(report.calls, options.sizes)

        def render(json_path: Path, md_path: Path) -> tuple[bytes, bytes]:
            report.json_path, report.md_path = str(json_path), str(md_path)
            return dumps_pretty(report.to_dict()), report.to_markdown().encode("utf-8")

        registry.write_probe_receipt(stamp_utc(now), render)
    return report


def run_demo(
    registry: Path | None,
    prompt: bytes,
    start: Callable[[], AbstractContextManager[str]],
    *,
    name: str,
    source: str,
    say: Say,
) -> DemoRun:
    """Add `prompt` as `name` to `registry` (None: a fresh temporary one), start a worker
    (`start`: its base URL while it runs, started once the prompt is added), warm the prompt
    and check it resumes, run a short probe (2 sizes, survival search), stop the worker."""
    root = registry or Path(tempfile.mkdtemp(prefix="prefixreg-demo-")) / "registry"
    reg = Registry(root)
    sha = reg.add(prompt, name=name, source=source)
    say(f"added the sample system prompt as {name} ({sha[:16]}) to {root}")
    with start() as url, Worker(url) as worker:
        warmed = warm(reg, reg.head(name), worker)
        say("warmed it and checked that a fresh call resumes it")
        probe = run_probe(reg, worker, ProbeOptions(sizes=(4000, 16000), foreign=9, survival=True))
        say("ran a short probe (2 sizes, survival search)")
    return DemoRun(root, warmed, probe)

"""The `audit` use case: judge each call against the head it sends, name the batch's head, build the
report. `audit_calls` is pure; `run_audit` reads the registry (public API, read only; a corrupt
record or object raises, never reads as "not registered").

A call's head is its own (its record's, or its request's bytes: the frame's when in line), else, for
a response read alone, the batch's; its span is that head's span on the call's build (measured:
the server's count on a resumed check; on an aligned engine, the estimate such a check covered),
else for a request the judge's byte estimate; a cached call with no head to
compare with is unverified (`judge_unknown_head`). The batch's head: (1) the registered head most
requests send byte-identically (the frame when most are in line), else (2) the head of the records
read when all calls come from them, else (3) the span measured on the batch's build(s) (any, when
none is named) that most responses read alone cover, through the judge (ties: longer, then newer): a
likeness. Never a mean of cached counts; never a probe slice (marked, or with a probe leg's span).

`audit_paths` is the `audit` command's use case: its option rules (a named registry must be one;
--frame needs a registry; --html is a user output), the audit, and the HTML page written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefixreg.core.errors import RefNotFoundError, RegistryLocationError, UsageError
from prefixreg.core.frame import Head
from prefixreg.core.judge import Judgement, counted_span, judge, judge_unknown_head
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.registry.store import Registry
from prefixreg.verbs.audit.identity import FrameAudit, IdentityReport, Lookup, check_identity
from prefixreg.verbs.audit.read import AuditCall, AuditInput, read_outputs
from prefixreg.verbs.audit.report import STATES, AuditReport, Method, PrefixSpan, SharedHead, rates


def prefix_spans(
    measurements: Iterable[Measurement], given: Iterable[PrefixSpan] = ()
) -> list[PrefixSpan]:
    """The latest resumed span per (head, build) over `given` and `measurements`."""
    latest: dict[tuple[str, str], PrefixSpan] = {}
    for s in [*given, *(_span(m) for m in measurements)]:
        if s is not None and latest.get((s.head, s.build_id), s).at <= s.at:
            latest[(s.head, s.build_id)] = s
    return sorted(latest.values(), key=lambda s: (s.head, s.build_id))


def _span(m: Measurement) -> PrefixSpan | None:
    o = m.outcome  # a probe leg's span only marks its slice: it never judges a call here
    align = m.build.snapshot_align if o.alignment is None else o.alignment
    if (span := counted_span(m)) is not None and not m.kind.startswith("probe-"):
        return PrefixSpan(m.sha256, m.build.build_id, span, align, m.at, m.kind, o.frame)
    if o.verdict != "resumed" or not o.span_tokens:  # partial or cold: a miss, not the head
        return None  # else the estimate a resumed check covered (an aligned engine's)
    at, kind = m.at, m.kind
    return PrefixSpan(
        m.sha256, m.build.build_id, o.span_tokens, align, at, kind, o.frame, "estimated"
    )


@dataclass(frozen=True, slots=True)
class Known:
    """What the registry consulted says (default: none): measured spans, names, head bytes by
    head id (a frame's: system and rendered tools), registered heads, probe slices, `lookup`."""

    spans: Sequence[PrefixSpan] = ()
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    sizes: Mapping[str, int] = field(default_factory=dict)
    registered: frozenset[str] | None = None
    probe_slices: frozenset[str] = frozenset()
    lookup: Lookup | None = None


def _against(ev: CallEvidence, span: PrefixSpan, known: Known) -> Judgement:
    """A response read alone, against a head's measured `span` (which a shorter prompt lacks)."""
    if ev.prompt_tokens is not None and ev.prompt_tokens < span.span_tokens:
        return judge_unknown_head(ev, f"its prompt is shorter than {span.head[:12]}'s span")
    return _by_span(ev, known.sizes.get(span.head, 0), span)


def _by_span(
    ev: CallEvidence, head_bytes: int, span: PrefixSpan | None, rest_bytes: int | None = None
) -> Judgement:
    """The judge against a head's span on the call's build: measured, or an estimate a
    resumed check confirmed (an aligned engine's); with none, by the bytes sent."""
    measured = span.span_tokens if span is not None and span.source == "measured" else None
    return judge(
        ev,
        head_bytes=head_bytes,
        rest_bytes=rest_bytes,
        alignment=0 if span is None else span.alignment,
        measured_span=measured,
        confirmed_span=span.span_tokens if span is not None and measured is None else None,
    )


def match_prefix(
    calls: Sequence[AuditCall],
    spans: Sequence[PrefixSpan],
    *,
    known: Known = Known(),
    identity: IdentityReport | None = None,
    frame: str | None = None,
) -> SharedHead | None:
    """The head the batch shares, or None (the module's rules); `frame`: most requests' frame."""
    probes = set(known.probe_slices) | {s.head for s in spans if s.kind.startswith("probe-")}
    builds = {c.build_id for c in calls if c.build_id is not None}
    ours = [s for s in spans if not builds or s.build_id in builds]
    ours = [s for s in ours if {s.sha256, s.head}.isdisjoint(probes)]
    heads = {(c.sha256 or "", c.frame) for c in calls}
    found: tuple[str, str | None, Method, int, int, PrefixSpan | None]
    if identity is not None and identity.batch_sha and identity.registered(identity.batch_sha)[0]:
        n = len(identity.of("identical"))
        if frame is not None:  # the frame is shared as far as requests send it whole
            n = sum(p.drift == () for p in identity.prompts)
        found = (identity.batch_sha, frame, "identity", n, len(identity.prompts), None)
    elif len(heads) == 1 and all(c.build_id for c in calls):
        found = (*heads.pop(), "records", len(calls), len(calls), None)
    else:
        alone = [c for c in calls if c.sha256 is None and c.evidence.cache_state != "unverified"]
        covered = {s: sum(_against(c.evidence, s, known).resumed for c in alone) for s in ours}
        best = max(ours, key=lambda s: (covered[s], s.span_tokens, s.at), default=None)
        if best is None or not covered[best]:
            return None
        found = (best.sha256, best.frame, "coverage", covered[best], len(alone), best)
    sha, fr, method, support, of, span = found
    head = fr or sha
    if {sha, head} & probes:
        return None
    if span is None:
        span = max((s for s in ours if s.head == head), key=lambda s: s.at, default=None)
    registered = None if known.registered is None else head in known.registered
    build_known = bool(builds) or method == "records"
    return SharedHead(
        sha, fr, known.names.get(head, ()), method, registered, support, of, build_known, span
    )


def _judge(
    c: AuditCall,
    spans: Mapping[tuple[str, str], PrefixSpan],
    shared: SharedHead | None,
    known: Known,
) -> Judgement:
    """The judge's verdict on one call, against the head it sends (the module's rules)."""
    head = c.frame or c.sha256
    if head is not None:
        own = spans.get((head, c.build_id)) if c.build_id else None
        size = known.sizes.get(head, 0) if c.head_bytes is None else c.head_bytes
        return _by_span(c.evidence, size, own, c.rest_bytes)
    if shared is not None and shared.span is not None:
        return _against(c.evidence, shared.span, known)
    why = "no head to compare them with (read without its request)"
    if shared is not None:
        why = f"no span of {shared.label()} on the batch's build to compare them with"
    return judge_unknown_head(c.evidence, f"cached tokens, but {why}")


def audit_calls(
    data: AuditInput,
    *,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    known: Known = Known(),
    frame: Head | None = None,
) -> AuditReport:
    """Judge and account for the calls read (`frame`: `data` was read against it); rates
    default to the measured Flash lane. The spans of the records read join `known.spans`,
    so a directory carrying its warm records names its head without a registry. Raises
    `UsageError`: a rate is not a positive number."""
    p_tps, d_tps = rates(prefill_tps, decode_tps)
    spans = prefix_spans(data.measurements, known.spans)
    identity = check_identity(data.prompts, known.lookup, known.probe_slices)
    framed = None
    if frame is not None:
        known = replace(known, sizes={**known.sizes, frame.sha256: frame.head_bytes})
        drifts = [p.drift for p in data.prompts if p.drift is not None]
        same = identity is not None and identity.batch_sha == frame.system.sha256
        in_line = frame.kind == "frame" and 2 * drifts.count(()) > len(drifts)
        framed = frame.sha256 if same and in_line else None
    shared = match_prefix(data.calls, spans, known=known, identity=identity, frame=framed)
    by_key = {(s.head, s.build_id): s for s in spans if not s.kind.startswith("probe-")}
    verdicts = tuple(_judge(c, by_key, shared, known) for c in data.calls)
    states = {c.source: STATES[v.verdict] for c, v in zip(data.calls, verdicts, strict=True)}
    rows = [(p.source, p.drift, states.get(p.source)) for p in data.prompts if p.drift is not None]
    return AuditReport(
        calls=tuple(data.calls),
        verdicts=verdicts,
        malformed=tuple(data.malformed),
        skipped=tuple(data.skipped),
        files=data.files,
        prefill_tps=p_tps,
        decode_tps=d_tps,
        rates_given=prefill_tps is not None or decode_tps is not None,
        prefix=shared,
        identity=identity,
        frame=None if frame is None else FrameAudit(frame, tuple(rows)),
    )


def run_audit(
    paths: Iterable[Path | str],
    *,
    registry: Registry | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    frame: Head | None = None,
) -> AuditReport:
    """Read `paths`, judge and account for them. `registry` (when it exists) supplies spans,
    names, sizes, registered heads and verified bytes; `frame` (`Registry.head`) names each
    request's drift from it.

    Raises:
        UsageError: a rate is not a positive number; an argument of the wrong type.
        CorruptRecordError: a registry measurement record does not parse (fail closed).
        IntegrityError: a registry object or frame the audit reads fails verification."""
    if registry is not None and not isinstance(registry, Registry):
        raise UsageError(f"registry must be a Registry, not {type(registry).__name__}")
    rates(prefill_tps, decode_tps)  # before reading anything
    data = read_outputs(paths, frame=frame)
    known = Known() if registry is None or not registry.exists else _known(registry, data, frame)
    return audit_calls(
        data, prefill_tps=prefill_tps, decode_tps=decode_tps, known=known, frame=frame
    )


def _known(registry: Registry, data: AuditInput, frame: Head | None) -> Known:
    spans = prefix_spans(registry.measurements())
    names: dict[str, tuple[str, ...]] = {}
    for name, sha in registry.names().items():
        names[sha] = (*names.get(sha, ()), name)
    objects = registry.list_objects()
    sizes = {o.sha256: o.bytes for o in objects if o.bytes is not None}
    registered = {o.sha256 for o in objects}
    frames = {s.frame for s in prefix_spans(data.measurements, spans) if s.frame}
    for sha in sorted(frames | ({frame.sha256} if frame is not None else set())):
        with contextlib.suppress(RefNotFoundError):
            sizes[sha] = registry.head(sha).head_bytes  # verified: a tampered part raises
            registered.add(sha)

    def lookup(sha: str, size: int) -> tuple[str, ...] | None:
        """Byte identity: the object read verified (re-hashed by the store), its length the
        request's (a mismatch is unreachable unless sha256 collides)."""
        try:
            return names.get(sha, ()) if len(registry.read_verified(sha)) == size else None
        except RefNotFoundError:
            return None

    probes = frozenset(o.sha256 for o in objects if o.probe_slice)
    return Known(spans, names, sizes, frozenset(registered), probes, lookup)


def audit_paths(
    paths: Iterable[Path | str],
    *,
    registry: Path | None = None,
    frame: str | None = None,
    html: Path | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> AuditReport:
    """`prefixreg audit`: the registry named (`registry`: the flag; None: $PREFIXREG_HOME or
    the default, which only adds names and spans when it exists), `frame` resolved once in
    it, `run_audit`, then the report as one HTML page at `html`. `say` gets the hints and,
    when nothing was read, the first ten inputs skipped and why.

    Raises:
        UsageError: a named registry that is not one; --frame without a registry; nothing
            readable (no call and no request); a bad rate or --html path.
        IntegrityError, CorruptRecordError: as `run_audit` (the store fails closed)."""
    reg = _open_registry(registry, say)
    if reg is not None and not reg.exists and registry is not None:
        raise UsageError(f"{registry}: not a registry")
    if frame is not None and (reg is None or not reg.exists):
        raise UsageError("--frame needs a registry that holds the frame")
    if html is not None:
        from prefixreg.registry.userfiles import check_output_file

        check_output_file(html, "--html")
    head = None if frame is None or reg is None else reg.head(frame)  # resolved once
    report = run_audit(
        paths, registry=reg, prefill_tps=prefill_tps, decode_tps=decode_tps, frame=head
    )
    if not report.calls and report.identity is None:
        for m in (*report.malformed, *report.skipped)[:10]:
            say(f"{m.source}: {m.reason}")
        raise UsageError(
            "no call outputs or requests read",
            hint="give response or request JSON, JSON lines, a directory of them, "
            "or measurement records",
        )
    if html is not None:
        from prefixreg.registry.fsutil import replace_atomic
        from prefixreg.verbs.audit.html import render_html

        replace_atomic(html, render_html(report), mode=0o644)
    return report


def _open_registry(flag: Path | None, say: Callable[[str], None]) -> Registry | None:
    """The registry `flag` names (else $PREFIXREG_HOME's or the default); None when the
    default location is unusable (a named one that is unusable raises)."""
    from prefixreg.registry.location import migration_hint, resolve_registry_path

    try:
        path = resolve_registry_path(flag)
        hint = migration_hint(path)  # an empty default location while ~/prefix-registry exists
        if hint is not None:
            say(f"hint: {hint}")
        return Registry(path)
    except RegistryLocationError:
        if flag is not None:
            raise
        return None

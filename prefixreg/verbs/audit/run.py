"""The `audit` use case: read the inputs, ask the registry, and build the report.

`audit_calls` is pure (everything it needs is passed in); `run_audit` adds what the
registry knows, through the store's public API only: measured spans (`measurements`),
which shas are registered and their names (`list_objects`), and, for byte identity, the
verified bytes of a request's prefix (`read_verified`, which re-hashes the stored object).

Invariants: reads only, writes nothing; a corrupt registry record or object raises (the
store fails closed) rather than being reported as "not registered".
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prefixreg.core.errors import RefNotFoundError, UsageError
from prefixreg.verbs.audit.framedrift import frame_audit
from prefixreg.verbs.audit.identity import Lookup, check_identity
from prefixreg.verbs.audit.match import PrefixSpan, match_prefix, merge_spans, prefix_spans
from prefixreg.verbs.audit.read import AuditInput, read_outputs
from prefixreg.verbs.audit.report import AuditReport
from prefixreg.verbs.audit.timemodel import DEFAULT_DECODE_TPS, DEFAULT_PREFILL_TPS, call_time

if TYPE_CHECKING:
    from prefixreg.core.frame import Frame
    from prefixreg.registry.store import Registry

__all__ = ["audit_calls", "registry_lookup", "run_audit"]


def audit_calls(
    data: AuditInput,
    *,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    spans: Sequence[PrefixSpan] = (),
    names: Mapping[str, Sequence[str]] | None = None,
    registered: set[str] | None = None,
    lookup: Lookup | None = None,
    frame: Frame | None = None,
    probe_slices: Collection[str] = (),
) -> AuditReport:
    """Account for the calls read. Pure. Rates default to the measured Flash lane.

    Spans from the records read are added to `spans`, so a directory that carries its
    warm records names its prefix without a registry. `lookup` (see `identity.Lookup`)
    answers whether a request's prefix is registered; None: no registry to ask. `frame`
    (with `data` read against it) adds each request's drift from the frame.
    `probe_slices` (shas the registry marks as probe slices) are never the batch's prefix.
    """
    _check_rates(prefill_tps, decode_tps)
    p_tps = prefill_tps if prefill_tps is not None else DEFAULT_PREFILL_TPS
    d_tps = decode_tps if decode_tps is not None else DEFAULT_DECODE_TPS
    times = tuple(call_time(c.evidence, prefill_tps=p_tps, decode_tps=d_tps) for c in data.calls)
    all_spans = merge_spans(spans, prefix_spans(data.measurements))
    return AuditReport(
        calls=tuple(data.calls),
        times=times,
        malformed=tuple(data.malformed),
        files=data.files,
        prefill_tps=p_tps,
        decode_tps=d_tps,
        rates_given=prefill_tps is not None or decode_tps is not None,
        prefix=match_prefix(
            data.calls, all_spans, names=names, registered=registered, probe_slices=probe_slices
        ),
        skipped=tuple(data.skipped),
        identity=check_identity(data.prompts, lookup, probe_slices),
        frame=None if frame is None else frame_audit(frame.sha256, frame.name, data),
    )


def _check_rates(prefill_tps: float | None, decode_tps: float | None) -> None:
    for rate, what in ((prefill_tps, "prefill"), (decode_tps, "decode")):
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise UsageError(f"--{what}-tps must be a positive number of tokens per second")


def registry_lookup(registry: Registry, names: Mapping[str, Sequence[str]]) -> Lookup:
    """A `Lookup` over `registry`: the object is read verified (re-hashed by the store) and
    its length compared with the request's, so a match is byte identity, not a name."""

    def lookup(sha: str, size: int) -> tuple[str, ...] | None:
        try:
            data = registry.read_verified(sha)
        except RefNotFoundError:
            return None
        if len(data) != size:  # unreachable unless sha256 collides; never claim identity
            return None
        return tuple(names.get(sha, ()))

    return lookup


def run_audit(
    paths: Iterable[Path | str],
    *,
    registry: Registry | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    frame: Frame | None = None,
) -> AuditReport:
    """Read `paths` and account for them; `registry` (when it exists) supplies measured
    spans, names, which shas are registered, and the verified bytes for byte identity;
    `frame` (verified) names each request's drift from it.

    Raises:
        UsageError: a rate is not a positive number.
        CorruptRecordError: a registry measurement record does not parse (fail closed).
        IntegrityError: a registry object a request names does not hash to its sha.
    """
    _check_rates(prefill_tps, decode_tps)
    data = read_outputs(paths, frame=frame)
    spans: list[PrefixSpan] = []
    names: dict[str, list[str]] = {}
    registered: set[str] | None = None
    lookup: Lookup | None = None
    probe_slices: set[str] = set()
    if registry is not None and registry.exists:
        spans = prefix_spans(registry.measurements())
        registered = set()
        for info in registry.list_objects():
            registered.add(info.sha256)
            if info.probe_slice:
                probe_slices.add(info.sha256)
            if info.names:
                names[info.sha256] = list(info.names)
        lookup = registry_lookup(registry, names)
    return audit_calls(
        data,
        prefill_tps=prefill_tps,
        decode_tps=decode_tps,
        spans=spans,
        names=names,
        registered=registered,
        lookup=lookup,
        frame=frame,
        probe_slices=probe_slices,
    )

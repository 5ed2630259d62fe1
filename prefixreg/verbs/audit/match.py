"""Naming a batch's shared prefix by token count: measured spans and the match against them.

Invariants:

- A span is the latest *resumed* warm record or probe leg per (prefix, build): a partial or
  cold check measured a miss, not the prefix.
- A batch is matched only against spans of its own server build(s) (DESIGN §3 rule 3); when
  it carries no build (plain responses), every build is searched and the match says the
  build is not known to be the batch's.
- When every call comes from measurement records of one prefix, that sha names it directly.
- A probe slice is never the batch's prefix: spans of probe legs (kind `probe-*`) and of
  objects the registry marks as probe slices are not candidates, and records of a probe
  slice name none.
- A token-count match is a likeness, not identity: `registered` says whether the sha is in
  the registry consulted (None: none was); byte identity is `identity.py`'s job. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.jsonio import JSONObject
from prefixreg.core.records import Measurement, strict_count
from prefixreg.verbs.audit.read import AuditCall

__all__ = [
    "PrefixMatch",
    "PrefixSpan",
    "match_prefix",
    "merge_spans",
    "prefix_spans",
    "span_tolerance",
]

# Tolerance of the prefix match: the batch's mean cached count against a measured span.
MATCH_MIN_TOKENS: Final = 64
MATCH_FRACTION: Final = 0.02


def _alignment_of(record: Measurement) -> int:
    """The server's snapshot alignment, from the record's body or its build identity."""
    value = strict_count(record.body.get("alignment"))
    return record.build.snapshot_align if value is None else value


@dataclass(frozen=True, slots=True)
class PrefixSpan:
    """A prefix's measured token span on one build: the latest resumed warm or probe leg."""

    sha256: str
    build_id: str
    span_tokens: int
    alignment: int
    at: str
    kind: str


def prefix_spans(measurements: Iterable[Measurement]) -> list[PrefixSpan]:
    """The latest resumed span per (prefix, build), from warm records and probe legs.

    Only measurements whose verdict is `resumed` count: a partial or cold check did not
    measure the prefix's span, it measured a miss.
    """
    latest: dict[tuple[str, str], PrefixSpan] = {}
    for m in measurements:
        span = strict_count(m.body.get("span_tokens"))
        if m.body.get("verdict") != "resumed" or not span:
            continue
        key = (m.sha256, m.build.build_id)
        entry = PrefixSpan(m.sha256, m.build.build_id, span, _alignment_of(m), m.at, m.kind)
        if key not in latest or latest[key].at <= m.at:
            latest[key] = entry
    return sorted(latest.values(), key=lambda s: (s.sha256, s.build_id))


def span_tolerance(span: PrefixSpan) -> int:
    """How far a mean cached count may sit from a span and still match it: the larger of
    64 tokens, 2% of the span, and the server's alignment (aligned engines round down)."""
    return max(MATCH_MIN_TOKENS, math.ceil(span.span_tokens * MATCH_FRACTION), span.alignment)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The prefix a batch shares, and how that was decided."""

    sha256: str
    names: tuple[str, ...]
    method: Literal["records", "mean_cached"]
    build_id: str | None
    build_known: bool
    span_tokens: int | None
    mean_cached: float | None
    difference: float | None
    tolerance: int | None
    registered: bool | None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "names": list(self.names),
            "method": self.method,
            "build_id": self.build_id,
            "build_known": self.build_known,
            "span_tokens": self.span_tokens,
            "mean_cached": self.mean_cached,
            "difference": self.difference,
            "tolerance": self.tolerance,
            "registered": self.registered,
        }

    def label(self) -> str:
        name = ", ".join(self.names)
        return f"{name} ({self.sha256[:12]})" if name else self.sha256


def match_prefix(
    calls: Sequence[AuditCall],
    spans: Sequence[PrefixSpan],
    *,
    names: Mapping[str, Sequence[str]] | None = None,
    registered: set[str] | None = None,
    probe_slices: Collection[str] = (),
) -> PrefixMatch | None:
    """Which prefix the batch shares, or None.

    - every call came from measurement records of one prefix: that sha, directly;
    - otherwise the mean cached count of the reused calls against the spans measured on the
      builds the batch's records name (every build when none does), closest within
      `span_tolerance`. `names` maps sha -> names; `registered` is the registry's shas
      (None: no registry to ask); `probe_slices` the shas it marks as probe slices.

    Neither way names a probe slice (see the module invariants): None instead.
    """
    names = names or {}

    def is_probe(s: PrefixSpan) -> bool:
        return s.kind.startswith("probe-") or s.sha256 in probe_slices

    def is_registered(sha: str) -> bool | None:
        return None if registered is None else sha in registered

    builds = {c.build_id for c in calls if c.build_id is not None}
    reused = [
        c.evidence.cached_tokens
        for c in calls
        if c.evidence.cache_state == "reused" and c.evidence.cached_tokens is not None
    ]
    mean = sum(reused) / len(reused) if reused else None
    shas = {c.sha256 for c in calls}
    sha = next(iter(shas)) if len(shas) == 1 else None
    if sha is not None:
        if sha in probe_slices or any(s.sha256 == sha and is_probe(s) for s in spans):
            return None
        own = [s for s in spans if s.sha256 == sha and s.build_id in builds]
        span = max(own, key=lambda s: s.at) if own else None
        return PrefixMatch(
            sha256=sha,
            names=tuple(names.get(sha, ())),
            method="records",
            build_id=span.build_id if span else (next(iter(builds)) if len(builds) == 1 else None),
            build_known=True,
            span_tokens=span.span_tokens if span else None,
            mean_cached=mean,
            difference=None if span is None or mean is None else abs(mean - span.span_tokens),
            tolerance=span_tolerance(span) if span else None,
            registered=is_registered(sha),
        )
    if mean is None:
        return None
    # Newest first, so that `min` (which keeps the first of equals) prefers it on a tie.
    candidates = sorted(
        (s for s in spans if (not builds or s.build_id in builds) and not is_probe(s)),
        key=lambda s: s.at,
        reverse=True,
    )
    within = [s for s in candidates if abs(mean - s.span_tokens) <= span_tolerance(s)]
    if not within:
        return None
    s = min(within, key=lambda s: abs(mean - s.span_tokens))
    return PrefixMatch(
        sha256=s.sha256,
        names=tuple(names.get(s.sha256, ())),
        method="mean_cached",
        build_id=s.build_id,
        build_known=bool(builds),
        span_tokens=s.span_tokens,
        mean_cached=mean,
        difference=abs(mean - s.span_tokens),
        tolerance=span_tolerance(s),
        registered=is_registered(s.sha256),
    )


def merge_spans(given: Sequence[PrefixSpan], read: Sequence[PrefixSpan]) -> list[PrefixSpan]:
    """The latest span per (prefix, build) across both sources."""
    latest: dict[tuple[str, str], PrefixSpan] = {}
    for s in [*given, *read]:
        key = (s.sha256, s.build_id)
        if key not in latest or latest[key].at <= s.at:
            latest[key] = s
    return sorted(latest.values(), key=lambda s: (s.sha256, s.build_id))

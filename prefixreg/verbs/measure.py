"""Measured calls: one chat call bracketed by `/cache` snapshots, its record, its judgement.

The building blocks `warm`, `probe` and `keepalive` share (none of them imports another verb):

- `measured_call` sends one call and keeps the `/cache` snapshots around it;
- `CallRecord` is that call as stored: evidence, snapshots, deltas, `interleaved`;
- `judge_resume` reads a resume check from the server's own counts (DESIGN §4);
- `record_measurement` writes one measurement, bound to the server build, through the store.

Invariants:
- A verdict comes from server-reported counts only, never from text length. `resumed` needs
  the cached count to cover the prefix's span: the share the prefix takes of the check's
  prompt (by bytes of message content), less an allowance for the server's alignment and the
  template tokens the estimate cannot see. The allowance scales with the span and is never
  larger than the span itself, so a short prefix is not "resumed" by one shared token.
- Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from prefixreg.core.errors import WorkerError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CacheCounters, CallEvidence, Measurement, ServerBuild
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.evidence import counter_deltas, is_interleaved
from prefixreg.server.worker import Worker

__all__ = [
    "SPAN_ALLOWANCE",
    "WARM_PARAMS",
    "CallRecord",
    "Verdict",
    "judge_resume",
    "measured_call",
    "record_measurement",
    "span_allowance",
]

Verdict = Literal["resumed", "partial", "cold", "unverified", "warmed"]

# Tokens the byte-share estimate of the prefix span may be off by: the chat template's
# fixed tokens around the system message, which the estimate cannot see. A ceiling: on a
# short span the allowance shrinks with it (see `span_allowance`).
SPAN_ALLOWANCE: Final = 32
# The share of the span the template allowance may take at most: a prefix whose cached
# count covers less than half of its estimated span was not resumed, whatever its size.
SPAN_ALLOWANCE_SHARE: Final = 0.5
WARM_PARAMS: Final[dict[str, Any]] = {"max_tokens": 1, "temperature": 0}


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One measured call: its evidence and the `/cache` snapshots around it."""

    phase: str
    tail_sha256: str
    evidence: CallEvidence
    before: CacheCounters | None
    after: CacheCounters | None

    @property
    def interleaved(self) -> bool | None:
        """Whether foreign traffic moved the counters in this call's window (None: no /cache)."""
        if self.before is None or self.after is None:
            return None
        return is_interleaved(self.before, self.after, 1)

    def to_dict(self) -> JSONObject:
        deltas: JSONValue = None
        if self.before is not None and self.after is not None:
            deltas = dict(counter_deltas(self.before, self.after))
        return {
            "phase": self.phase,
            "tail_sha256": self.tail_sha256,
            "evidence": self.evidence.to_dict(),
            "cache_before": None if self.before is None else self.before.to_dict(),
            "cache_after": None if self.after is None else self.after.to_dict(),
            "cache_deltas": deltas,
            "interleaved": self.interleaved,
        }


def measured_call(
    worker: Worker,
    prefix: Prefix | Frame,
    *,
    phase: str,
    tail: str,
    with_cache: bool,
    before: CacheCounters | None = None,
    **params: Any,
) -> CallRecord:
    """Send one chat call bracketed by `/cache` snapshots (when the server has `/cache`).

    `before` reuses the previous call's closing snapshot, so back-to-back calls cost one
    `/cache` read each. A closing snapshot the server fails to give is recorded as missing
    (its window then counts for nothing): the call was made and its evidence must not be lost.
    """
    if with_cache and before is None:
        before = worker.cache()
    _, evidence = worker.chat(prefix, tail, **{**WARM_PARAMS, **params})
    after = None
    if with_cache:
        try:
            after = worker.cache()
        except WorkerError:
            after = None
    return CallRecord(
        phase=phase,
        tail_sha256=hashlib.sha256(tail.encode("utf-8")).hexdigest(),
        evidence=evidence,
        before=before,
        after=after,
    )


def record_measurement(
    registry: Registry, worker: Worker, build: ServerBuild, sha256: str, kind: str, body: JSONObject
) -> tuple[Measurement, Path]:
    """Write one measurement of `kind` for `sha256`, bound to `build`; returns it and its path."""
    measurement = Measurement(
        sha256=sha256,
        at=iso_utc(utc_now()),
        kind=kind,
        build=build,
        body=body,
        worker=worker.url,
        model=worker.model,
    )
    return measurement, registry.write_measurement(measurement)


def span_allowance(span: int, alignment: int) -> int:
    """Tokens a resume check may fall short of `span` and still count as resumed.

    The server's alignment (an aligned engine rounds the cached count down to a multiple of
    it) plus `SPAN_ALLOWANCE` template tokens; but never more than `SPAN_ALLOWANCE_SHARE` of
    the span, so the allowance never swallows the span it is about. On an aligned server a
    span shorter than one alignment unit cannot be resumed at all, and that is the answer.
    """
    if span <= 0:
        return 0
    return min(alignment + SPAN_ALLOWANCE, math.floor(span * SPAN_ALLOWANCE_SHARE))


def judge_resume(
    evidence: CallEvidence, *, prefix_bytes: int, tail_bytes: int, alignment: int
) -> tuple[Verdict, str, int | None, float | None]:
    """Classify a resume check: (verdict, reason, estimated prefix span, coverage).

    The span is the prefix's share of the check's prompt tokens, by bytes of content; the
    check resumed the prefix when its cached count reaches the span less `span_allowance`.
    """
    if evidence.cache_state == "unverified":
        return (
            "unverified",
            evidence.reason or "the server did not report cached tokens",
            None,
            None,
        )
    prompt, cached = evidence.prompt_tokens, evidence.cached_tokens
    if prompt is None or cached is None:  # cold/reused evidence always carries both
        return "unverified", "the server did not report prompt and cached counts", None, None
    total = prefix_bytes + tail_bytes
    span = math.floor(prompt * prefix_bytes / total) if total > 0 else 0
    coverage = min(1.0, cached / span) if span > 0 else None
    if evidence.cache_state == "cold":
        return "cold", "the resume check was served cold (0 cached tokens)", span, 0.0
    if span > 0 and cached >= span - span_allowance(span, alignment):
        reason = f"{cached:,} of {prompt:,} prompt tokens came from the cache"
        return "resumed", reason, span, coverage
    reason = f"only {cached:,} cached tokens against a prefix span of about {span:,}"
    return "partial", reason, span, coverage

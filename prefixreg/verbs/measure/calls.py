"""Measured calls: one chat call bracketed by `/cache` snapshots, its record, its judgement.

The one module verbs share besides the judge (`prefixreg.core.judge`); no verb imports
another:

- `measured_call` sends one call with a head and keeps the `/cache` snapshots around it;
- `CallRecord` is that call as stored: evidence, snapshots, deltas, `interleaved`;
- `judge_check` judges a resume check of a head (the judge, with the head's measured span
  on this build and the bytes of the tail it was sent with);
- `measured_span` is a head's span as this build's last resumed warm of it measured it;
- `record_measurement` writes one measurement, bound to the server build, through the store.

Invariants:
- A verdict comes from `core.judge` only, from server-reported counts, never text length.
- Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import WorkerError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.judge import Judgement, judge
from prefixreg.core.records import CacheCounters, CallEvidence, Measurement, ServerBuild
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.counters import counter_deltas, is_interleaved
from prefixreg.server.worker import Worker

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
    head: Head,
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
    _, evidence = worker.chat(head, tail, **{**WARM_PARAMS, **params})
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


def head_warms(registry: Registry, head: Head, build_id: str) -> list[Measurement]:
    """This build's warm measurements of `head` (of this very head: a frame's, or the bare
    prefix's, never another head sharing its system bytes), oldest first."""
    frame = head.sha256 if head.kind == "frame" else None
    return [
        m
        for m in registry.measurements(head.system.sha256)
        if m.kind == "warm" and m.build.build_id == build_id and m.outcome.frame == frame
    ]


def measured_span(registry: Registry, head: Head, build_id: str) -> int | None:
    """The head's span in tokens as this build's last resumed warm of it measured it."""
    for m in reversed(head_warms(registry, head, build_id)):
        if m.outcome.verdict == "resumed" and m.outcome.span_tokens:
            return m.outcome.span_tokens
    return None


def judge_check(
    evidence: CallEvidence,
    head: Head,
    *,
    tail: str,
    alignment: int,
    measured: int | None = None,
    tools_tokens: int | None = None,
) -> Judgement:
    """The judge's verdict on a resume check of `head` sent with `tail`."""
    return judge(
        evidence,
        head_bytes=head.head_bytes,
        rest_bytes=len(tail.encode("utf-8")),
        alignment=alignment,
        measured_span=measured,
        tools_tokens=tools_tokens,
    )

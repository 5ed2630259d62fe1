"""Frames at work: judge a loop's calls against the frame it sends, and name its drift.

- `LoopJudge`: reads each loop call against the frame's last warm on the current build.
  A call is `resumed` only when the judge says its cached count covers the span that warm
  measured; when this build's last warm of the system prefix was of another head (the
  bare system prompt, another frame) every call is a `frame-mismatch`, never `resumed`; a
  call whose body differs from the frame is `drift`, naming the part.
- `drift_report`: over a batch of (request body, cache state) pairs, each drift event with
  the cold calls that follow it (`audit` over request bodies).

Verdicts come from the judge (`core.judge`); nothing here reads text lengths.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prefixreg.core.frame import Frame
from prefixreg.core.judge import judge
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.audit.framedrift import DriftEvent, drift_events

LoopVerdict = Literal[
    "resumed", "partial", "cold", "unverified", "drift", "frame-mismatch", "unwarmed"
]


def last_warm(registry: Registry, frame: Frame, build_id: str) -> Measurement | None:
    """The newest warm measurement of the frame's system prefix on build `build_id` (of
    this frame or of any other head that shares the system bytes), or None."""
    found = [
        m
        for m in registry.measurements(frame.system.sha256)
        if m.kind == "warm" and m.build.build_id == build_id
    ]
    return found[-1] if found else None


def _head_of(measurement: Measurement) -> str:
    sha = measurement.outcome.frame
    return f"frame {sha[:12]}" if sha else "the bare system prompt"


@dataclass(slots=True)
class LoopJudge:
    """Judges a loop's calls against `frame`, from its last warm on the worker's build."""

    frame: Frame
    build_id: str
    alignment: int
    baseline: Measurement | None
    calls: list[tuple[LoopVerdict, str]] = field(default_factory=list)

    @classmethod
    def for_worker(cls, registry: Registry, frame: Frame, worker: Worker) -> LoopJudge:
        build = worker.server_build()
        return cls(
            frame, build.build_id, build.snapshot_align, last_warm(registry, frame, build.build_id)
        )

    @property
    def span(self) -> int | None:
        """The frame's span in tokens, as its last warm here measured it (None: not warmed
        as this frame on this build)."""
        if self.baseline is None or self.baseline.outcome.frame != self.frame.sha256:
            return None
        return self.baseline.outcome.span_tokens

    def observe(
        self, evidence: CallEvidence, body: Mapping[str, Any] | None = None
    ) -> tuple[LoopVerdict, str]:
        """Judge one call (its server evidence, and its request body when known)."""
        verdict, detail = self._judge(evidence, body)
        self.calls.append((verdict, detail))
        return verdict, detail

    def _judge(
        self, evidence: CallEvidence, body: Mapping[str, Any] | None
    ) -> tuple[LoopVerdict, str]:
        drift = [] if body is None else self.frame.drift(body)
        if drift:
            return "drift", "; ".join(str(d) for d in drift)
        if self.baseline is None:
            return "unwarmed", "no warm of this frame's system prefix on this build"
        span = self.span
        if span is None:
            return (
                "frame-mismatch",
                f"this build's last warm sent {_head_of(self.baseline)}, not frame "
                f"{self.frame.sha256[:12]} (its tools and settings were never warmed)",
            )
        j = judge(
            evidence,
            head_bytes=self.frame.head_bytes,
            alignment=self.alignment,
            measured_span=span,
        )
        if j.verdict == "resumed":
            return "resumed", f"{j.cached_tokens:,} cached covers the frame's span of {span:,}"
        return j.verdict, j.reason


def drift_report(
    frame: Frame, calls: Iterable[tuple[Mapping[str, Any], str | None]]
) -> list[DriftEvent]:
    """Each change of drift along a batch of (request body, cache state) pairs, in order.

    An event starts where a call's drift differs from the previous call's (the first
    drifting call, or a further change) and counts the cold calls up to the next change
    (`prefixreg.verbs.audit.framedrift.drift_events`).
    """
    return drift_events([(tuple(frame.drift(body)), state) for body, state in calls])

"""Frames at work: warm a frame's head, judge a loop's calls against it, say who lost it.

- `warm_frame`: `warm` of the frame's whole head (system bytes, tools, settings), byte for
  byte as the loop sends it; the measurement is filed under the system sha and records the
  frame's sha (`body.frame`).
- `LoopJudge`: reads each loop call against the frame's last warm on the current build.
  A call is `resumed` only when its cached count covers the span that warm measured; when
  this build's last warm of the system prefix was of another head (the bare system prompt,
  another frame) every call is a `frame-mismatch`, never `resumed`; a call whose body
  differs from the frame is `drift`, naming the part.
- `drift_report`: over a batch of (request body, cache state) pairs, each drift event with
  the cold calls that follow it (`audit` over request bodies).
- `diagnose`: after `warm --check-only` of a frame, whether the frame or the server lost it.

Verdicts come from server counts only (DESIGN §4); nothing here reads text lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prefixreg.core.frame import Frame
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.registry.frames import get_frame
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.audit.framedrift import DriftEvent, drift_events
from prefixreg.verbs.measure import span_allowance
from prefixreg.verbs.warm import WarmResult, warm_prefix

__all__ = [
    "DriftEvent",
    "LoopJudge",
    "LoopVerdict",
    "diagnose",
    "drift_report",
    "last_warm",
    "warm_frame",
]

LoopVerdict = Literal[
    "resumed", "partial", "cold", "unverified", "drift", "frame-mismatch", "unwarmed"
]


def warm_frame(
    registry: Registry,
    ref: str,
    worker: Worker,
    *,
    check: bool = True,
    warm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> WarmResult:
    """`warm` of frame `ref`: verified first (`IntegrityError`: nothing sent), then its head.

    Raises:
        RefNotFoundError: `ref` names no frame. IntegrityError: the record or a part fails.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    frame = get_frame(registry, ref)
    return warm_prefix(
        registry,
        frame.system.sha256,
        worker,
        check=check,
        warm=warm,
        progress=progress,
        frame=frame,
    )


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
    sha = measurement.body.get("frame")
    return f"frame {sha[:12]}" if isinstance(sha, str) else "the bare system prompt"


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
        if self.baseline is None or self.baseline.body.get("frame") != self.frame.sha256:
            return None
        span = self.baseline.body.get("span_tokens")
        return span if type(span) is int and span > 0 else None

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
        cached, prompt = evidence.cached_tokens, evidence.prompt_tokens
        if evidence.cache_state == "unverified" or cached is None or prompt is None:
            return "unverified", evidence.reason or "the server did not report cached tokens"
        if evidence.cache_state == "cold":
            return "cold", f"0 of {prompt:,} prompt tokens cached"
        if cached >= span - span_allowance(span, self.alignment):
            return "resumed", f"{cached:,} cached covers the frame's span of {span:,}"
        return "partial", f"{cached:,} cached, short of the frame's span of {span:,}"


def drift_report(
    frame: Frame, calls: Iterable[tuple[Mapping[str, Any], str | None]]
) -> list[DriftEvent]:
    """Each change of drift along a batch of (request body, cache state) pairs, in order.

    An event starts where a call's drift differs from the previous call's (the first
    drifting call, or a further change) and counts the cold calls up to the next change
    (`prefixreg.verbs.audit.framedrift.drift_events`).
    """
    return drift_events([(tuple(frame.drift(body)), state) for body, state in calls])


def diagnose(registry: Registry, result: WarmResult) -> str:
    """After `warm --check-only` of a frame: who lost it, the frame or the server."""
    frame = result.frame
    if frame is None or any(c.phase == "warm" for c in result.calls):
        return ""  # only a check alone needs telling apart
    build = result.build.build_id
    warms = [
        m
        for m in registry.measurements(frame.system.sha256)
        if m.kind == "warm"
        and m.build.build_id == build
        and m.sha256 == frame.system.sha256
        and any(c.get("phase") == "warm" for c in _calls(m))
    ]
    mine = [m for m in warms if m.body.get("frame") == frame.sha256]
    if result.verdict == "resumed":
        return (
            "the server holds this frame: loop calls that came back cold sent another head "
            "(see the drift of their request bodies)"
        )
    if not mine:
        other = f" (the last warm here sent {_head_of(warms[-1])})" if warms else ""
        return f"the frame lost it: frame {frame.sha256[:12]} was never warmed on this build{other}"
    return f"the server lost it: the frame was warmed at {mine[-1].at} and is gone since"


def _calls(m: Measurement) -> Sequence[Mapping[str, Any]]:
    calls = m.body.get("calls")
    return [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []

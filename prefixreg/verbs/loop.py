"""The loop's side: judge each call against the frame it sends, and keep running totals.

- `LoopJudge`: reads each loop call against the frame's last warm on the current build.
  A call is `resumed` only when the judge says its cached count covers the span that warm
  measured; when this build's last warm of the system prefix was of another head (the
  bare system prompt, another frame) every call is a `frame-mismatch`, never `resumed`; a
  call whose body differs from the frame is `drift`, naming the part.
- `LoopStats`: running totals over a loop's calls, from the server's own evidence.

Verdicts come from the judge (`core.judge`); nothing here reads text lengths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import judge
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker

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


@dataclass(slots=True)
class LoopStats:
    """Running totals over a loop's calls."""

    calls: int = 0
    resumed: int = 0
    cold: int = 0
    unverified: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    def add(self, evidence: CallEvidence) -> CallEvidence:
        """Count one call; returns the evidence so a loop can write `stats.add(ev)` inline."""
        self.calls += 1
        if evidence.wall_s is not None:
            self.wall_s += evidence.wall_s
        if evidence.cache_state == "unverified":
            self.unverified += 1
            return evidence
        if evidence.cache_state == "reused":
            self.resumed += 1
        else:
            self.cold += 1
        self.prompt_tokens += evidence.prompt_tokens or 0
        self.cached_tokens += evidence.cached_tokens or 0
        self.completion_tokens += evidence.completion_tokens or 0
        return evidence

    @property
    def resumed_fraction(self) -> float | None:
        """Share of verified prompt tokens that came from the cache (None before any)."""
        return None if self.prompt_tokens == 0 else self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> JSONObject:
        return {
            "calls": self.calls,
            "resumed": self.resumed,
            "cold": self.cold,
            "unverified": self.unverified,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "resumed_fraction": self.resumed_fraction,
            "wall_s": round(self.wall_s, 6),
        }

    def __str__(self) -> str:
        frac = self.resumed_fraction
        share = "-" if frac is None else f"{frac:.1%}"
        return (
            f"{self.calls} calls: {self.resumed} resumed, {self.cold} cold, "
            f"{self.unverified} unverified; {self.cached_tokens:,} of {self.prompt_tokens:,} "
            f"prompt tokens from the cache ({share})"
        )

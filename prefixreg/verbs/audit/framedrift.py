"""Frame drift over an audited batch: which part of each request left its frame, and the cold
calls that followed (`audit --frame`).

Reading (`read.read_outputs(..., frame=...)`) keeps, per request, only the drift that
`Frame.drift` names (part and detail: shas, setting values), never the request's text. A
request paired with its response (`{"request", "response"}`) carries the response's cache
state; a bare request body carries none, and its event says how many calls had an answer.

Events (`drift_events`): an event starts where a call's drift differs from the previous
call's (the first drifting call, a further change) and counts the cold calls from there up
to the next change; a return to the frame ends an event and starts none. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Drift

if TYPE_CHECKING:
    from prefixreg.verbs.audit.read import AuditInput

__all__ = ["DriftEvent", "FrameAudit", "FrameCall", "drift_events", "frame_audit"]

CacheState = str | None


@dataclass(frozen=True, slots=True)
class DriftEvent:
    """Calls `index` onwards drifted from the frame in `drift`; of the `calls` calls from
    there to the next change, `answered` carried a server answer and `cold_after` were cold."""

    index: int
    drift: tuple[Drift, ...]
    cold_after: int
    calls: int
    answered: int | None = None

    def __str__(self) -> str:
        parts = "; ".join(str(d) for d in self.drift) or "back in line with the frame"
        answered = self.calls if self.answered is None else self.answered
        known = "" if answered == self.calls else f" ({answered} with a server answer)"
        return (
            f"call {self.index}: {parts} — {self.cold_after} of the {self.calls} calls "
            f"that follow were cold{known}"
        )

    def to_dict(self) -> JSONObject:
        drift: list[JSONValue] = [{"part": d.part, "detail": d.detail} for d in self.drift]
        return {
            "index": self.index,
            "drift": drift,
            "calls": self.calls,
            "answered": self.calls if self.answered is None else self.answered,
            "cold_after": self.cold_after,
        }


def drift_events(rows: Sequence[tuple[tuple[Drift, ...], CacheState]]) -> list[DriftEvent]:
    """Each change of drift along (drift, cache state) rows in call order."""
    events: list[DriftEvent] = []
    previous: tuple[Drift, ...] = ()
    start: int | None = None
    for i, (drift, _) in enumerate([*rows, ((), None)]):
        if drift == previous and i < len(rows):
            continue
        if start is not None and previous:
            segment = rows[start:i]
            cold = sum(1 for _, state in segment if state == "cold")
            answered = sum(1 for _, state in segment if state is not None)
            events.append(DriftEvent(start, previous, cold, len(segment), answered))
        start, previous = i, drift
    return events


@dataclass(frozen=True, slots=True)
class FrameCall:
    """One request of the batch against the frame: where it was read, what drifted, and
    its response's cache state when the response was paired with it."""

    source: str
    drift: tuple[Drift, ...]
    cache_state: CacheState

    def to_dict(self) -> JSONObject:
        drift: list[JSONValue] = [{"part": d.part, "detail": d.detail} for d in self.drift]
        return {"source": self.source, "drift": drift, "cache_state": self.cache_state}


@dataclass(frozen=True, slots=True)
class FrameAudit:
    """The batch's requests read against one frame, in call order."""

    frame: str
    name: str | None
    calls: tuple[FrameCall, ...]

    @property
    def events(self) -> list[DriftEvent]:
        return drift_events([(c.drift, c.cache_state) for c in self.calls])

    @property
    def drifted(self) -> list[FrameCall]:
        return [c for c in self.calls if c.drift]

    def to_dict(self) -> JSONObject:
        return {
            "frame": self.frame,
            "name": self.name,
            "requests": len(self.calls),
            "in_line": len(self.calls) - len(self.drifted),
            "drifted": len(self.drifted),
            "events": [e.to_dict() for e in self.events],
            "calls": [c.to_dict() for c in self.calls],
        }

    def text_lines(self, *, limit: int = 10) -> list[str]:
        pad = " " * 15
        label = f"{self.name} " if self.name else ""
        n, bad = len(self.calls), self.drifted
        lines = [
            f"frame          {n - len(bad):,} of {n:,} requests in line with frame "
            f"{label}{self.frame[:16]}"
        ]
        events = self.events
        if events:
            lines.append(f"{pad}drift ({len(events):,} changes):")
            lines.extend(f"{pad}  {e}" for e in events[:limit])
            if len(events) > limit:
                lines.append(f"{pad}  ... and {len(events) - limit:,} more (see --json)")
        if bad:
            lines.append(f"{pad}drifted requests ({len(bad):,}):")
            for c in bad[:limit]:
                parts = ", ".join(d.part for d in c.drift)
                state = f" [{c.cache_state}]" if c.cache_state else ""
                lines.append(f"{pad}  {c.source}: {parts}{state}")
            if len(bad) > limit:
                lines.append(f"{pad}  ... and {len(bad) - limit:,} more (see --json)")
        return lines


def frame_audit(frame: str, name: str | None, data: AuditInput) -> FrameAudit:
    """The requests of `data` (read with this frame) against it; a request paired with its
    response takes that response's cache state."""
    states = {c.source: c.evidence.cache_state for c in data.calls}
    calls = tuple(
        FrameCall(source, drift, states.get(source) if paired else None)
        for source, drift, paired in data.heads
    )
    return FrameAudit(frame, name, calls)

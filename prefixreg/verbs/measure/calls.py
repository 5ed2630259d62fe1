"""Measured calls: one chat (or completions) call bracketed by `/cache` snapshots (the one place
a call is measured) and its record; measurements bound to the build, written through the
store, and what this build's measurements of a head say (its warms, its counted span).

Invariants:
- A verdict comes from `core.judge` only, from server-reported counts, never text length.
- Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import WorkerError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject, JSONValue, dumps_ordered
from prefixreg.core.judge import counted_span
from prefixreg.core.records import CacheCounters, CallEvidence, Measurement, ServerBuild
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.counters import counter_deltas, is_interleaved
from prefixreg.server.engines import METRICS, Metrics, window
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
    window: JSONObject | None = None  # an engine's Prometheus over the call (`engines.window`)

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
        out: JSONObject = {
            "phase": self.phase,
            "tail_sha256": self.tail_sha256,
            "evidence": self.evidence.to_dict(),
            "cache_before": None if self.before is None else self.before.to_dict(),
            "cache_after": None if self.after is None else self.after.to_dict(),
            "cache_deltas": deltas,
            "interleaved": self.interleaved,
        }
        return out if self.window is None else out | {"counter_window": self.window}


class Bracket:
    """The counters around one call, opened before it is sent (`/cache` when `with_cache`,
    else the engine's Prometheus counters where the build has them, `engines.METRICS`: a
    witness, never the verdict) and closed on its evidence (`close`). `before` reuses the
    previous call's closing snapshot; one the server fails to give is recorded as missing
    (its window counts for nothing), never losing the call's evidence. Without `witness` no
    counter window is read (a call among concurrent ones has none of its own)."""

    def __init__(
        self,
        worker: Worker,
        build: ServerBuild,
        *,
        with_cache: bool,
        before: CacheCounters | None = None,
        witness: bool = True,
    ) -> None:
        self.worker, self.with_cache = worker, with_cache
        self.before = worker.cache() if with_cache and before is None else before
        self.metrics = None if with_cache or not witness else METRICS.get(build.profile)
        self.start = _samples(worker, self.metrics)

    def close(self, phase: str, sent_sha256: str, evidence: CallEvidence) -> CallRecord:
        """The call's record: `sent_sha256` names what was sent (a tail's, a history's)."""
        after = None
        if self.with_cache:
            with contextlib.suppress(WorkerError):
                after = self.worker.cache()
        seen = None
        if self.metrics is not None:
            end = _samples(self.worker, self.metrics)
            seen = window(self.metrics, self.start, end, evidence.prompt_tokens)
        return CallRecord(phase, sent_sha256, evidence, self.before, after, seen)


def sent_sha256(tail: str | None, history: Sequence[Mapping[str, Any]] | None) -> str:
    """The sha256 a call's record names: of its tail, else of its history (ordered JSON)."""
    text = dumps_ordered(list(history)) if history is not None else (tail or "")
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def measured_call(
    worker: Worker,
    head: Head,
    *,
    build: ServerBuild,
    phase: str,
    tail: str,
    with_cache: bool,
    before: CacheCounters | None = None,
    **params: Any,
) -> CallRecord:
    """One chat call of `head` and a one-line `tail` on `build` (the caller's
    `Worker.server_build()`: its rule reads a missing count), in a `Bracket`."""
    bracket = Bracket(worker, build, with_cache=with_cache, before=before)
    evidence = worker.chat(head, tail, build=build, **{**WARM_PARAMS, **params})[1]
    return bracket.close(phase, sent_sha256(tail, None), evidence)


def measured_completion(
    worker: Worker,
    prompt: str | Sequence[int],
    *,
    build: ServerBuild,
    phase: str,
    prompt_sha256: str,
    with_cache: bool,
    before: CacheCounters | None = None,
    witness: bool = True,
    **params: Any,
) -> CallRecord:
    """One streamed `/v1/completions` call of `prompt` (text or token IDs), in a `Bracket`;
    `prompt_sha256` is what its record names."""
    bracket = Bracket(worker, build, with_cache=with_cache, before=before, witness=witness)
    evidence = worker.complete(prompt, build=build, **params)[1]
    return bracket.close(phase, prompt_sha256, evidence)


def _samples(worker: Worker, metrics: Metrics | None) -> dict[str, float] | None:
    """An engine's Prometheus samples, or None (no counters, or they cannot be read)."""
    try:
        return None if metrics is None else worker.metrics(metrics.path)
    except WorkerError:
        return None


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


def build_warms(registry: Registry, system_sha: str, build_id: str) -> list[Measurement]:
    """This build's warm measurements filed under a system prefix (of any head), oldest first."""
    warms = registry.measurements(system_sha)
    return [m for m in warms if m.kind == "warm" and m.build.build_id == build_id]


def head_warms(registry: Registry, head: Head, build_id: str) -> list[Measurement]:
    """This build's warm measurements of this very head (a frame's, or the bare prefix's,
    never another head sharing its system bytes), oldest first."""
    frame = head.sha256 if head.kind == "frame" else None
    warms = build_warms(registry, head.system.sha256, build_id)
    return [m for m in warms if m.outcome.frame == frame]


def last_counted_span(registry: Registry, head: Head, build_id: str) -> int | None:
    """The head's span in tokens as the server counted it on this build's last resumed
    check of it (`core.judge.counted_span`); None: none measured it."""
    spans = (counted_span(m) for m in reversed(head_warms(registry, head, build_id)))
    return next((span for span in spans if span is not None), None)


def latest_qualify(registry: Registry, build_id: str) -> Measurement | None:
    """This build's latest `qualify` measurement (any phase of its last run), or None."""
    found = [m for m in registry.measurements() if m.kind == "qualify"]
    return next((m for m in reversed(found) if m.build.build_id == build_id), None)


def qualify_note(m: Measurement) -> str:
    """What a `qualify` measurement says, in the words of its receipt (the judge's)."""
    body = m.body
    fixture = body.get("fixture_sha256")
    shown = fixture[:12] if isinstance(fixture, str) else "?"
    said = "qualified" if body.get("qualified") is True else "not qualified"
    failures = body.get("failures")
    first = failures[0] if isinstance(failures, list) and failures else None
    why = f" ({first})" if isinstance(first, str) else ""
    return f"the latest qualify run of this build ({m.at}, fixture {shown}): {said}{why}"


def sent_head(warm: Measurement) -> str:
    """What a warm measurement sent: `frame <sha>` or `the bare system prompt`."""
    sha = warm.outcome.frame
    return f"frame {sha[:12]}" if sha else "the bare system prompt"

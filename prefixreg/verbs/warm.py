"""`warm`: put a registered prefix into a worker's prompt cache and prove it resumes.

Sequence (DESIGN §4): resolve and verify the prefix (an `IntegrityError` here means no
request is sent), read the server build from a fresh `/health`, snapshot `/cache`, send the
warm call (prefix as `messages[0]`, a short tail, `max_tokens` 1, temperature 0), snapshot,
send the resume check with a fresh never-seen tail, snapshot, re-read the build, and write
one measurement record.

Verdict of the resume check, from the server's own counts only:

- `resumed`: its cached count covers the prefix's span: the share the prefix takes of the
  check's prompt (by bytes of message content), less the server's snapshot alignment and a
  small allowance for the template tokens that estimate cannot see;
- `partial`: reused, but short of that span (a foreign prompt sharing a few leading tokens,
  an aligned engine rounding a short prefix down to nothing useful);
- `cold`: a verified count of zero; `unverified`: the server did not report what the claim
  needs (or the build changed in the middle).

Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from prefixreg.core.errors import UsageError, WorkerError
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import CacheCounters, CallEvidence, Measurement, ServerBuild
from prefixreg.registry.store import Registry, iso_utc, utc_now
from prefixreg.server.evidence import counter_deltas, is_interleaved
from prefixreg.server.worker import Worker

__all__ = [
    "SPAN_ALLOWANCE",
    "CallRecord",
    "Verdict",
    "WarmResult",
    "judge_resume",
    "measured_call",
    "record_measurement",
    "warm_prefix",
]

Verdict = Literal["resumed", "partial", "cold", "unverified", "warmed"]

# Tokens the byte-share estimate of the prefix span may be off by: the chat template's
# fixed tokens around the system message, which the estimate cannot see.
SPAN_ALLOWANCE: Final = 32
WARM_PARAMS: Final[dict[str, Any]] = {"max_tokens": 1, "temperature": 0}


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call of a measurement: its evidence and the `/cache` snapshots around it."""

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


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What `warm_prefix` did and found."""

    prefix: Prefix
    worker_url: str
    build: ServerBuild
    calls: tuple[CallRecord, ...]
    verdict: Verdict
    reason: str
    span_tokens: int | None
    coverage: float | None
    alignment: int
    measurement: Measurement
    record_path: str

    @property
    def check(self) -> CallRecord | None:
        return next((c for c in self.calls if c.phase == "check"), None)

    def receipt(self, *, public: bool = False) -> JSONObject:
        """The JSON a script reads (`--json`); `public` drops the worker address and model."""
        out = self.measurement.to_dict(public=public)
        out["record"] = None if public else self.record_path
        return out


def measured_call(
    worker: Worker,
    prefix: Prefix,
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


def judge_resume(
    evidence: CallEvidence, *, prefix_bytes: int, tail_bytes: int, alignment: int
) -> tuple[Verdict, str, int | None, float | None]:
    """Classify a resume check: (verdict, reason, estimated prefix span, coverage).

    The span is the prefix's share of the check's prompt tokens, by bytes of content; the
    check resumed the prefix when its cached count reaches the span less the server's
    alignment and `SPAN_ALLOWANCE`.
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
    span = math.floor(prompt * prefix_bytes / (prefix_bytes + tail_bytes))
    coverage = min(1.0, cached / span) if span > 0 else None
    if evidence.cache_state == "cold":
        return "cold", "the resume check was served cold (0 cached tokens)", span, 0.0
    if cached >= span - alignment - SPAN_ALLOWANCE:
        reason = f"{cached:,} of {prompt:,} prompt tokens came from the cache"
        return "resumed", reason, span, coverage
    reason = f"only {cached:,} cached tokens against a prefix span of about {span:,}"
    return "partial", reason, span, coverage


def warm_prefix(
    registry: Registry,
    ref: str,
    worker: Worker,
    *,
    check: bool = True,
    warm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> WarmResult:
    """Warm `ref` on `worker`, then (unless `check` is False) prove a fresh call resumes it.

    `warm=False` sends the resume check alone: is the prefix still resumable right now?

    Raises:
        IntegrityError: the prefix's bytes do not verify (nothing was sent).
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    if not (warm or check):
        raise UsageError("nothing to do: neither the warm call nor the resume check")
    registry.refuse_on_mirror("record measurements")  # before anything is sent
    say = progress or (lambda _msg: None)
    prefix = registry.get(ref)  # verified: an IntegrityError leaves before any request
    build = worker.server_build()
    with_cache = build.profile == "halogen"
    say(f"warming {prefix.sha256[:12]} on {worker.url} ({build.profile}, build {build.build_id})")
    calls: list[CallRecord] = []
    if warm:
        calls.append(
            measured_call(worker, prefix, phase="warm", tail=fresh_tail(), with_cache=with_cache)
        )
    alignment = build.snapshot_align
    span: int | None = None
    coverage: float | None = None
    if check:
        say("resume check with a fresh tail")
        check_tail = fresh_tail()
        calls.append(
            measured_call(
                worker,
                prefix,
                phase="check",
                tail=check_tail,
                with_cache=with_cache,
                before=calls[-1].after if calls else None,
            )
        )
        verdict, reason, span, coverage = judge_resume(
            calls[-1].evidence,
            prefix_bytes=prefix.size,
            tail_bytes=len(check_tail.encode("utf-8")),
            alignment=alignment,
        )
    else:
        ev = calls[0].evidence
        verdict = "unverified" if ev.cache_state == "unverified" else "warmed"
        reason = ev.reason or "warm call completed with verified counts"
    after_build = worker.server_build()
    if after_build.build_id != build.build_id:
        verdict, reason = "unverified", "the server build changed during the measurement"
    last = calls[-1].evidence
    body: JSONObject = {
        "verdict": verdict,
        "reason": reason,
        "prefix_bytes": prefix.size,
        "prompt_tokens": last.prompt_tokens,
        "cached_tokens": last.cached_tokens,
        "span_tokens": span,
        "coverage": coverage,
        "alignment": alignment,
        "calls": [c.to_dict() for c in calls],
    }
    measurement, path = record_measurement(registry, worker, build, prefix.sha256, "warm", body)
    return WarmResult(
        prefix=prefix,
        worker_url=worker.url,
        build=build,
        calls=tuple(calls),
        verdict=verdict,
        reason=reason,
        span_tokens=span,
        coverage=coverage,
        alignment=alignment,
        measurement=measurement,
        record_path=str(path),
    )

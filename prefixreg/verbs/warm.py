"""`warm`: put a registered prefix into a worker's prompt cache and prove it resumes.

Sequence (DESIGN §4): resolve and verify the prefix (an `IntegrityError` here means no
request is sent), read the server build from a fresh `/health`, snapshot `/cache`, send the
warm call (prefix as `messages[0]`, a short tail, `max_tokens` 1, temperature 0), snapshot,
send the resume check with a fresh never-seen tail, snapshot, re-read the build, and write
one measurement record.

Verdict of the resume check, from the server's own counts only:

- `resumed`: its cached count covers the prefix's span: the share the prefix takes of the
  check's prompt (by bytes of message content), less an allowance for the server's snapshot
  alignment and the template tokens that estimate cannot see, which scales with the span
  and never exceeds half of it (`measure.span_allowance`);
- `partial`: reused, but short of that span (a foreign prompt sharing a few leading tokens,
  an aligned engine rounding a short prefix down to nothing useful);
- `cold`: a verified count of zero; `unverified`: the server did not report what the claim
  needs (or the build changed in the middle).

A measurement during which `/cache` saw foreign calls (a window whose hits + misses moved by
more than our one call) keeps its verdict but is marked `interleaved` and not `clean`, and
its headline says so ("COLD — foreign calls interleaved; not a clean measurement"): `show`
prefers clean measurements. The call helpers live in `prefixreg.verbs.measure`.

Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure import (
    SPAN_ALLOWANCE,
    WARM_PARAMS,
    CallRecord,
    Verdict,
    judge_resume,
    measured_call,
    record_measurement,
)

__all__ = [
    "INTERLEAVED_NOTE",
    "SPAN_ALLOWANCE",
    "WARM_PARAMS",
    "CallRecord",
    "Verdict",
    "WarmResult",
    "judge_resume",
    "measured_call",
    "record_measurement",
    "warm_prefix",
]

INTERLEAVED_NOTE = "foreign calls interleaved; not a clean measurement"


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
    interleaved: bool | None = None
    frame: Frame | None = None

    @property
    def clean(self) -> bool:
        """No foreign traffic was seen in any window of this measurement (or no /cache)."""
        return self.interleaved is not True

    @property
    def headline(self) -> str:
        """`COLD`, or `COLD — foreign calls interleaved; not a clean measurement`."""
        head = self.verdict.upper()
        return head if self.clean else f"{head} — {INTERLEAVED_NOTE}"

    @property
    def check(self) -> CallRecord | None:
        return next((c for c in self.calls if c.phase == "check"), None)

    def receipt(self, *, public: bool = False) -> JSONObject:
        """The JSON a script reads (`--json`); `public` drops the worker address and model."""
        out = self.measurement.to_dict(public=public)
        out["record"] = None if public else self.record_path
        return out


def warm_prefix(
    registry: Registry,
    ref: str,
    worker: Worker,
    *,
    check: bool = True,
    warm: bool = True,
    progress: Callable[[str], None] | None = None,
    frame: Frame | None = None,
) -> WarmResult:
    """Warm `ref` on `worker`, then (unless `check` is False) prove a fresh call resumes it.

    `warm=False` sends the resume check alone: is the prefix still resumable right now?
    `frame` (already verified, its system prefix `ref`) sends the frame's whole head, tools
    and settings included, and the measurement records the frame's sha.

    Raises:
        IntegrityError: the prefix's bytes do not verify (nothing was sent).
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    if not (warm or check):
        raise UsageError("nothing to do: neither the warm call nor the resume check")
    registry.refuse_on_mirror("record measurements")  # before anything is sent
    say = progress or (lambda _msg: None)
    prefix = registry.get(ref)  # verified: an IntegrityError leaves before any request
    head: Prefix | Frame = prefix if frame is None else frame
    build = worker.server_build()
    with_cache = build.profile == "halogen"
    say(f"warming {prefix.sha256[:12]} on {worker.url} ({build.profile}, build {build.build_id})")
    calls: list[CallRecord] = []
    if warm:
        calls.append(
            measured_call(worker, head, phase="warm", tail=fresh_tail(), with_cache=with_cache)
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
                head,
                phase="check",
                tail=check_tail,
                with_cache=with_cache,
                before=calls[-1].after if calls else None,
            )
        )
        verdict, reason, span, coverage = judge_resume(
            calls[-1].evidence,
            prefix_bytes=prefix.size if frame is None else frame.head_bytes,
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
    # Foreign traffic in any window: the counts are still the server's, but what they say
    # about *this* prefix may be someone else's doing (an eviction, a shared snapshot).
    windows = [c.interleaved for c in calls]
    interleaved = True if any(windows) else (None if None in windows else False)
    body: JSONObject = {
        "verdict": verdict,
        "reason": reason,
        "interleaved": interleaved,
        "clean": interleaved is not True,
        "prefix_bytes": prefix.size,
        "prompt_tokens": last.prompt_tokens,
        "cached_tokens": last.cached_tokens,
        "span_tokens": span,
        "coverage": coverage,
        "alignment": alignment,
        "calls": [c.to_dict() for c in calls],
    }
    if frame is not None:
        body["frame"] = frame.sha256
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
        interleaved=interleaved,
        frame=frame,
    )

"""`warm`: put a head (a prefix or a frame) into a worker's prompt cache and prove it resumes.

Sequence (DESIGN §4), after the caller verified the head (`Registry.head`; an
`IntegrityError` there sends nothing): read the build from a fresh `/health`, snapshot
`/cache`, send the warm call (the head, a short tail, `max_tokens` 1, temperature 0),
snapshot, send the resume check with a fresh never-seen tail, snapshot, re-read the build,
write one measurement under the system sha (a frame's also names the frame).

The check's verdict is the judge's (`core.judge`): the cached count must cover the head's
span (measured on this build when it was, else its share of the prompt by bytes) less the
engine's allowance. A frame whose tools add no prompt tokens on this server (llama.cpp:
`/apply-template` + `/tokenize` with and without them) is not resumed for its tools.
`--check-only` of a frame also says who lost it, frame or server. A measurement during
which `/cache` saw foreign calls keeps its verdict but is `interleaved`, not `clean`
("COLD — foreign calls interleaved; not a clean measurement"); `show` prefers clean ones.

Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from prefixreg.core.errors import UsageError, check_progress, check_type
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import Judgement, judge_warm_only
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import Measurement, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker, check_worker
from prefixreg.verbs.measure.calls import CallRecord, build_warms, head_warms, sent_head
from prefixreg.verbs.measure.metrics import Metrics
from prefixreg.verbs.measure.trial import Trial


def _fmt(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What `warm` did and found."""

    head: Head
    worker_url: str
    build: ServerBuild
    calls: tuple[CallRecord, ...]
    verdict: str  # resumed | partial | cold | unverified | warmed
    reason: str
    judgement: Judgement | None
    measurement: Measurement
    record_path: str
    labels: tuple[str, ...] = ()  # each call judged against the head (the judge's words)
    interleaved: bool | None = None
    diagnosis: str = ""

    @property
    def prefix(self) -> Prefix:
        return self.head.system

    @property
    def frame(self) -> Frame | None:
        return self.head if isinstance(self.head, Frame) else None

    @property
    def span_tokens(self) -> int | None:
        return None if self.judgement is None else self.judgement.span

    @property
    def coverage(self) -> float | None:
        return None if self.judgement is None else self.judgement.coverage

    @property
    def check(self) -> CallRecord | None:
        return next((c for c in self.calls if c.phase == "check"), None)

    @property
    def clean(self) -> bool:
        """No foreign traffic was seen in any window of this measurement (or no /cache)."""
        return self.interleaved is not True

    @property
    def headline(self) -> str:
        """`COLD`, or `COLD — foreign calls interleaved; not a clean measurement`."""
        note = "" if self.clean else " — foreign calls interleaved; not a clean measurement"
        return self.verdict.upper() + note

    def summary(self) -> str:
        """The text a person reads: the head, the worker, each call, the verdict."""
        p, frame, build = self.prefix, self.frame, self.build
        version = build.identity.get("version")
        api = version.get("api") if isinstance(version, dict) else None
        lines: list[str] = []
        if frame:
            lines.append(f"frame    {frame.name + ' ' if frame.name else ''}{frame.sha256[:16]}")
        lines += [
            f"prefix   {p.name + ' ' if p.name else ''}{p.sha256[:16]} ({p.size:,} bytes)",
            f"worker   {self.worker_url}  {build.profile} build {build.build_id}"
            + (f" (api {api})" if api else ""),
        ]
        for call, label in zip(self.calls, self.labels, strict=True):
            ev = call.evidence
            wall = "-" if ev.wall_s is None else f"{ev.wall_s:.3f} s"
            src = f" from {ev.cached_source}" if ev.cached_source else ""
            counts = f"prompt {_fmt(ev.prompt_tokens)}, cached {_fmt(ev.cached_tokens)}{src}"
            lines.append(f"{call.phase:<8} {counts} ({label}), {wall}")
        span = "" if self.span_tokens is None else f"; prefix span ~{self.span_tokens:,} tokens"
        cov = "" if self.coverage is None else f", coverage {self.coverage:.1%}"
        lines.append(f"verdict  {self.headline}: {self.reason}{span}{cov}")
        lines.append(f"record   {self.record_path}")
        if self.diagnosis:
            lines.append(f"why      {self.diagnosis}")
        return "\n".join(lines) + "\n"

    def metrics(self) -> Metrics:
        """This warm as Prometheus gauges (`--metrics-file`), labelled by head and worker."""
        out = Metrics()
        labels = {"head": self.head.sha256[:16], "kind": self.head.kind, "worker": self.worker_url}
        if self.head.name:
            labels["name"] = self.head.name
        for verdict in ("resumed", "partial", "cold", "unverified", "warmed"):
            help_text = "1 for the verdict of the last warm of this head, else 0"
            is_it = float(self.verdict == verdict)
            out.set("prefixreg_warm_verdict", is_it, help_text, {**labels, "verdict": verdict})
        ev = self.calls[-1].evidence
        for name, value, help_text in (
            ("prefixreg_warm_prompt_tokens", ev.prompt_tokens, "Prompt tokens of the last call"),
            ("prefixreg_warm_cached_tokens", ev.cached_tokens, "Cached tokens of the last call"),
            ("prefixreg_warm_span_tokens", self.span_tokens, "The head's span the judge used"),
            ("prefixreg_warm_coverage_ratio", self.coverage, "Cached share of the head's span"),
            ("prefixreg_warm_call_seconds", ev.wall_s, "Wall seconds of the last call"),
        ):
            if value is not None:
                out.set(name, value, help_text, labels)
        stamp = datetime.fromisoformat(self.measurement.at.replace("Z", "+00:00")).timestamp()
        when = "Unix time of the last warm of this head"
        out.set("prefixreg_warm_last_run_timestamp_seconds", stamp, when, labels)
        return out

    def receipt(self, *, public: bool = False) -> JSONObject:
        """The JSON a script reads (`--json`); `public` drops the worker address and model."""
        out = self.measurement.to_dict(public=public)
        out["record"] = None if public else self.record_path
        if self.diagnosis:
            out["diagnosis"] = self.diagnosis
        return out


def warm(
    registry: Registry,
    head: Head,
    worker: Worker,
    *,
    check: bool = True,
    send_warm: bool = True,
    progress: Callable[[str], None] | None = None,
) -> WarmResult:
    """Warm `head` on `worker`, then (unless `check` is False) prove a fresh call resumes it;
    `send_warm=False` sends the resume check alone (is the head still resumable right now?).

    Raises:
        UsageError: neither call asked for, not a head, or the registry is a mirror.
        WorkerError: the worker could not be reached or answered an HTTP error.
    """
    check_type(registry, Registry, "warm: registry", "a Registry (prefixreg.open_registry())")
    check_type(head, (Prefix, Frame), "warm: head", "a Prefix or a Frame (Registry.head)")
    check_worker(worker, "warm: worker")
    check_type(check, bool, "warm: check", "True or False")
    check_type(send_warm, bool, "warm: send_warm", "True or False")
    check_progress(progress, "warm: progress")
    if not (send_warm or check):
        raise UsageError("nothing to do: neither the warm call nor the resume check")
    registry.refuse_on_mirror("record measurements")  # before anything is sent
    say = progress or (lambda _msg: None)
    trial = Trial(registry, worker, head)
    build = trial.build
    say(f"warming {head.sha256[:12]} on {worker.url} ({build.profile}, build {build.build_id})")
    steps = [trial.call("warm")] if send_warm else []
    if check:
        say("resume check with a fresh tail")
        steps.append(last := trial.call("check"))
        judgement: Judgement | None = last.judgement
        verdict: str = last.judgement.verdict
        reason = last.judgement.reason
        seen = last.record.window
        if verdict == "unverified" and seen is not None and seen["attributed"] is True:
            reason += f"; {seen['source']} counted {seen['cached_tokens']} cached tokens in the "
            reason += "call's window (a second witness, no per-call proof)"
    else:
        judgement = None
        verdict, reason = judge_warm_only(steps[0].record.evidence)
    verdict, reason = trial.same_build(verdict, reason)
    calls = [step.record for step in steps]
    evidence = calls[-1].evidence
    # Foreign traffic in any window: the counts are still the server's, but what they say
    # about *this* head may be someone else's doing (an eviction, a shared snapshot).
    windows = [c.interleaved for c in calls]
    interleaved = True if any(windows) else (None if None in windows else False)
    body: JSONObject = {
        **(judgement.to_dict() if judgement is not None else {}),
        "verdict": verdict,
        "reason": reason,
        "interleaved": interleaved,
        "clean": interleaved is not True,
        "prefix_bytes": head.system.size,
        "head_bytes": head.head_bytes,
        "prompt_tokens": evidence.prompt_tokens,
        "cached_tokens": evidence.cached_tokens,
        "alignment": trial.alignment,
        "calls": [c.to_dict() for c in calls],
    }
    diagnosis = "" if send_warm else diagnose(registry, head, build, verdict)
    measurement, path = trial.finish("warm", body)
    return WarmResult(
        head=head,
        worker_url=worker.url,
        build=build,
        calls=tuple(calls),
        verdict=verdict,
        reason=reason,
        judgement=judgement,
        measurement=measurement,
        record_path=str(path),
        labels=tuple(step.verdict for step in steps),
        interleaved=interleaved,
        diagnosis=diagnosis,
    )


def diagnose(registry: Registry, head: Head, build: ServerBuild, verdict: str) -> str:
    """After a check alone of a frame: who lost it, the frame or the server."""
    if head.frame_sha256 is None:
        return ""
    if verdict == "resumed":
        text = "the server holds this frame: loop calls that came back cold sent another head "
        return text + "(see the drift of their request bodies)"
    mine = [m for m in head_warms(registry, head, build.build_id) if "warm" in m.outcome.phases]
    if mine:
        return f"the server lost it: the frame was warmed at {mine[-1].at} and is gone since"
    warms = build_warms(registry, head.system.sha256, build.build_id)
    others = [m for m in warms if "warm" in m.outcome.phases]
    other = f" (the last warm here sent {sent_head(others[-1])})" if others else ""
    return f"the frame lost it: frame {head.sha256[:12]} was never warmed on this build{other}"


def check_warm_options(
    *,
    public: bool,
    json_out: bool,
    no_check: bool,
    check_only: bool,
    restore: bool,
    slot_dir: Path | None,
) -> None:
    """`warm`'s option rules, before the registry is opened (UsageError, the message names
    the flags to change)."""
    if public and not json_out:
        raise UsageError("--public shapes the --json receipt; add --json")
    if no_check and check_only:
        raise UsageError("--no-check and --check-only exclude each other")
    if slot_dir is not None and not restore:
        raise UsageError("--slot-dir is for --restore; add --restore")
    if restore and (no_check or check_only or public):
        raise UsageError(
            "--restore always proves with a check; drop --no-check/--check-only/--public"
        )

"""The loop's side: judge each call against the head it sends, and keep running totals.
Verdicts come from the judge (`core.judge`); nothing here reads text lengths.

- `LoopJudge` reads each loop call against the head on the worker's build: the judge's
  verdict against the span the server counted on this build's last resumed check of the
  head (`measure.calls.last_counted_span`), else against the head's share of the call's request
  body; with neither, `unverified`. A call observed with no request body is never
  `resumed` (nothing shows it sent the head: `judge_without_body` says unverified, and
  why). A frame's tools that the server's template drops are never resumed. When this
  build's last warm of the system prefix was of another head (the bare system prompt,
  another frame) every call is a `head-mismatch`, never `resumed`; a call whose request
  body differs from the head is `drift`, naming the part.
- `LoopStats` keeps the totals: calls by the judge's verdict (against `head` and the call's
  request body when it judges them itself), and the server's token counts over the calls
  whose counts are verified (a missing count is never zero).
- `Session` is one conversation of a loop on its head: it builds each request body as the
  head sends it and, once the call returned, tells a keeper (`KeepAlive.track`) or appends
  the body as one JSON line to a file (`prefixreg keepalive --session FILE`), so the loop's
  whole request is kept warm. A body is refused (UsageError) before either unless it is a
  request body a worker reads (`check_body`). The file is appended to only if it is a regular
  file (a FIFO or a directory is refused, never waited on) that no other local user could
  write (`userfiles.refuse_shared`: the keeper re-sends its lines with the user's key), one
  line whole or not at all (a short write on a full disk is cut back). With `call_log`, each
  call's request hashes and server evidence go to it as one `prefixreg-call` line
  (`server.calllog`), the shape `prefixreg audit` reads: no prompt or output text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

from prefixreg.core.errors import ArgumentTypeError, ArgumentValueError, UsageError, check_type
from prefixreg.core.frame import Frame, Head, beyond_prefix, not_a_prefix_call
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import judge, judge_unknown_head, judge_without_body
from prefixreg.core.prefix import Prefix, rest_bytes
from prefixreg.core.records import CallEvidence, Measurement
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import check_output_file, refuse_shared
from prefixreg.server.calllog import append_line, call_line
from prefixreg.server.worker import Worker, check_body, check_worker
from prefixreg.verbs.measure.calls import build_warms, last_counted_span, sent_head
from prefixreg.verbs.measure.trial import tools_tokens

LoopVerdict = Literal["resumed", "partial", "cold", "unverified", "drift", "head-mismatch"]
VERDICTS: tuple[LoopVerdict, ...] = get_args(LoopVerdict)


def _evidence(value: object) -> CallEvidence:
    if not isinstance(value, CallEvidence):
        raise UsageError(f"expected a CallEvidence, not {type(value).__name__}")
    return value


@dataclass(slots=True)
class LoopStats:
    """Running totals over a loop's calls, each counted under the judge's verdict; with
    `head`, `add` judges a call itself when given no verdict (a `LoopJudge` judges better)."""

    head: Head | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0))
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0

    def add(
        self,
        evidence: CallEvidence,
        verdict: LoopVerdict | None = None,
        *,
        body: Mapping[str, Any] | None = None,
    ) -> CallEvidence:
        """Count one call under `verdict`, else the judge's against `head` and the call's
        request `body` (without it the head's share of the prompt is unknown: `unverified`;
        without a head, a cached call is `unverified`); returns the evidence, for
        `stats.add(ev)` inline. Raises UsageError: a wrong type, or not a loop verdict."""
        evidence, head = _evidence(evidence), self.head
        rest = None if body is None else rest_bytes(body)
        if verdict is None and head is not None:
            verdict = judge(evidence, head_bytes=head.head_bytes, rest_bytes=rest).verdict
        elif verdict is None:
            verdict = judge_unknown_head(evidence, "no head to compare it with").verdict
        if verdict not in self.counts:
            raise UsageError(f"not a loop verdict: {verdict!r}; one of {', '.join(VERDICTS)}")
        self.counts[verdict] += 1
        if evidence.wall_s is not None:
            self.wall_s += evidence.wall_s
        if evidence.cache_state != "unverified":  # the server's counts, valid and complete
            self.prompt_tokens += evidence.prompt_tokens or 0
            self.cached_tokens += evidence.cached_tokens or 0
            self.completion_tokens += evidence.completion_tokens or 0
        return evidence

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    @property
    def resumed(self) -> int:
        return self.counts["resumed"]

    @property
    def partial(self) -> int:
        return self.counts["partial"]

    @property
    def cold(self) -> int:
        return self.counts["cold"]

    @property
    def unverified(self) -> int:
        return self.counts["unverified"]

    @property
    def resumed_fraction(self) -> float | None:
        """Share of verified prompt tokens that came from the cache (None before any)."""
        return None if self.prompt_tokens == 0 else self.cached_tokens / self.prompt_tokens

    def to_dict(self) -> JSONObject:
        out: JSONObject = {"calls": self.calls, **self.counts, "prompt_tokens": self.prompt_tokens}
        out |= {"cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens}
        return out | {"resumed_fraction": self.resumed_fraction, "wall_s": round(self.wall_s, 6)}

    def __str__(self) -> str:
        share = "-" if self.resumed_fraction is None else f"{self.resumed_fraction:.1%}"
        counted = ", ".join(f"{n} {v}" for v, n in self.counts.items() if n or v == "resumed")
        return (
            f"{self.calls} calls: {counted}; {self.cached_tokens:,} of {self.prompt_tokens:,} "
            f"prompt tokens from the cache ({share})"
        )


@dataclass(slots=True)
class LoopJudge:
    """Judges a loop's calls against `head` on the worker's build (`for_worker` reads it)."""

    head: Head
    build_id: str
    alignment: int
    baseline: Measurement | None  # this build's last warm of the head's system prefix
    span: int | None = None  # the head's span the server counted here (`last_counted_span`)
    tools_tokens: int | None = None  # what a frame's tools add here (0: the template drops them)
    stats: LoopStats = field(default_factory=LoopStats)
    calls: list[tuple[LoopVerdict, str]] = field(default_factory=list)

    @classmethod
    def for_worker(cls, registry: Registry, head: Head, worker: Worker) -> LoopJudge:
        """Read the worker's build now, the head's warms on it from `registry`, and what a
        frame's tools add to a prompt there."""
        where = "LoopJudge.for_worker"
        check_type(registry, Registry, f"{where}: registry", "a Registry (open_registry())")
        check_type(head, (Prefix, Frame), f"{where}: head", "a Prefix or a Frame (Registry.head)")
        check_worker(worker, f"{where}: worker")
        build = worker.server_build()
        warms = build_warms(registry, head.system.sha256, build.build_id)
        tools = tools_tokens(worker, build, head)
        span = last_counted_span(registry, head, build.build_id)
        baseline = warms[-1] if warms else None
        return cls(head, build.build_id, build.snapshot_align, baseline, span, tools)

    def observe(
        self, evidence: CallEvidence, body: Mapping[str, Any] | None = None
    ) -> tuple[LoopVerdict, str]:
        """Judge one call (and its request body when known), count it; (verdict, why)."""
        evidence = _evidence(evidence)
        if body is not None and not isinstance(body, Mapping):
            raise UsageError(f"body must be a request body (a mapping), not {type(body)}")
        verdict, detail = self._judge(evidence, body)
        self.calls.append((verdict, detail))
        self.stats.add(evidence, verdict)
        return verdict, detail

    def _judge(
        self, evidence: CallEvidence, body: Mapping[str, Any] | None
    ) -> tuple[LoopVerdict, str]:
        drift = "" if body is None else "; ".join(map(str, self.head.drift(body)))
        if drift:
            return "drift", drift
        if self.baseline is not None and self.baseline.outcome.frame != self.head.frame_sha256:
            head = f"{self.head.kind} {self.head.sha256[:12]}"
            why = f"this build's last warm sent {sent_head(self.baseline)}, not {head}"
            return "head-mismatch", f"{why} (what the loop sends was never warmed)"
        j = judge(
            evidence,
            head_bytes=self.head.head_bytes,
            rest_bytes=None if body is None else rest_bytes(body),
            alignment=self.alignment,
            measured_span=self.span,
            tools_tokens=self.tools_tokens,
        )
        if body is None:  # nothing shows the call sent this head: never resumed on counts
            j = judge_without_body(j, f"{self.head.kind} {self.head.sha256[:12]}")
        return j.verdict, j.reason


class Tracker(Protocol):
    def track(self, body: Mapping[str, Any]) -> str: ...


@dataclass(slots=True)
class Session:
    """One loop conversation on `head`: `body(history, **params)` builds each request, and
    `sent(body)`, once the call returned, tells `keeper` (a `KeepAlive`) and appends the
    body to `log` (a JSON-lines file a `prefixreg keepalive --session` in another process
    reads) and, with the call's evidence, a call record to `call_log` (what `prefixreg audit`
    reads); `calls` counts the bodies taken. Raises UsageError: a wrong type or value, or a
    `call_log` that is no file's place (a directory, a FIFO, a missing directory)."""

    head: Head
    keeper: Tracker | None = None
    log: Path | str | None = None
    calls: int = 0
    call_log: Path | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.head, Prefix | Frame):
            raise ArgumentTypeError(
                f"Session takes a Prefix or a Frame, not {type(self.head).__name__}"
            )
        if self.keeper is not None and not callable(getattr(self.keeper, "track", None)):
            raise UsageError("Session: keeper must be a KeepAlive (it has track(body))")
        log: object = self.log  # callers outside the type checker pass anything
        if log is not None and (not isinstance(log, str | Path) or "\0" in str(log)):
            raise ArgumentTypeError(f"Session: log is a file's path, not {log!r:.80}")
        if log is not None:  # never inside a registry root, nor a directory or FIFO
            check_output_file(Path(log), "Session log")
        calls: object = self.calls
        if type(calls) is not int or calls < 0:
            kind = ArgumentTypeError if type(calls) is not int else ArgumentValueError
            raise kind(f"Session: calls is a whole number >= 0, not {calls!r}")
        call_log: object = self.call_log
        if call_log is not None:
            check_type(call_log, (str, Path), "Session: call_log", "a file's path")
            if "\0" in str(call_log):
                raise ArgumentValueError(f"Session: call_log holds a NUL byte: {call_log!r:.80}")
            check_output_file(Path(str(call_log)), "the call log")  # before any call is made

    def body(self, history: Sequence[Mapping[str, Any]], **params: Any) -> dict[str, Any]:
        """The request body of the next call: the head, then `history` (`Frame.body`)."""
        return self.head.body(history, **params)

    def sent(self, body: Mapping[str, Any], evidence: CallEvidence | None = None) -> None:
        """The loop sent `body` and the call returned (`evidence`: what the server said of it,
        `Worker.chat`'s or `evidence_from_response`'s): keep it warm from now on, and record
        the call in `call_log`. Raises UsageError (nothing told, nothing written): not a
        request body a worker reads; a `call_log` and no evidence; a log that cannot be
        written (its line then left out whole)."""
        given: object = body  # callers outside the type checker pass anything
        if not isinstance(given, Mapping) or not isinstance(given.get("messages"), list):
            what = type(given).__name__
            raise UsageError(f"Session.sent() takes a request body with messages, not a {what}")
        line = check_body(dict(given), "Session.sent()") + b"\n"  # before it is told or written
        extra = given.get("extra_body")
        sent = {**given, **extra} if isinstance(extra, Mapping) else given
        if fields := beyond_prefix(self.head, sent):
            harm = "a keeper would warm a prompt the loop never sends"
            raise UsageError(f"Session.sent(): {not_a_prefix_call(self.head, fields, harm)}")
        record = None
        check_type(
            evidence, (CallEvidence, type(None)), "Session.sent(): evidence", "a CallEvidence"
        )
        if evidence is not None or self.call_log is not None:
            if self.call_log is not None and evidence is None:
                raise UsageError(
                    "Session.sent(): the call log records the call's evidence; pass it"
                )
            stamp = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            record = call_line(given, _evidence(evidence), head=self.head, at=stamp)
        if self.keeper is not None:
            self.keeper.track(given)
        if (log := self.log) is not None:
            # a keeper would refuse a shared file: its lines go out with the key
            append_line(log, line, lambda st: refuse_shared(st, log))
        if self.call_log is not None and record is not None:
            append_line(self.call_log, record)
        self.calls += 1

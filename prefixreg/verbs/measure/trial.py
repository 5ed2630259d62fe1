"""`Trial`: one head measured on one worker, the one measuring path of every verb that proves
a head (warm, snapshot save and restore, keepalive's re-warms, pool proofs).

A trial reads the server build once and works out once what the judge needs of its head on
that build: the head's span as the server counted it (the build's last resumed check of this
head, `calls.last_counted_span`), the engine's alignment and, for a frame whose tools reach
the prompt on llama.cpp, the tokens they add (`tools_tokens`, read the first time a cached
count could be judged against them). `call()` sends one call in a `calls.Bracket` (the one
place a call's counters are read), chains the `/cache` snapshots from call to call, and
judges it once (`core.judge`); it keeps no list of them (a keeper's trial lives for hours).
`restore()` is the only restore of a slot; `same_build()` re-reads the build (a change makes
the verdict `unverified`); `finish()` writes the measurement.

Invariants:
- Every call of a trial is judged by one rule against the same span, alignment and tools
  tokens; a verdict stands on the server's counts only, never on text length.
- A restore is proven only by a pinned check (`judge_restore`): `n_restored` is no evidence,
  and an erase reply without its count is no baseline.
- Records hold counts and hashes only: never the key, the tail text or the output text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import WorkerHTTPError
from prefixreg.core.frame import Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import (
    Judgement,
    judge,
    judge_restore,
    judge_same_build,
    judge_unproven,
)
from prefixreg.core.prefix import fresh_tail, text_bytes
from prefixreg.core.records import CacheCounters, Measurement, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.server.slots import SlotTransfer, slot_action
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import (
    WARM_PARAMS,
    Bracket,
    CallRecord,
    last_counted_span,
    record_measurement,
    sent_sha256,
)

# What a session re-touched whole adds beyond its head and history: one short turn, judged
# as a fresh tail's bytes (the tail itself is not sent).
_TURN_BYTES: Final = len(fresh_tail().encode("utf-8"))


def tools_tokens(worker: Worker, build: ServerBuild, head: Head) -> int | None:
    """Prompt tokens a frame's tools add on this server, told without a prefill (llama.cpp:
    the template tokenized with and without them); None if it cannot tell or none render."""
    if build.profile != "llamacpp" or not head.renders_tools:
        return None
    body = head.body([{"role": "user", "content": "x"}])
    with_tools = worker.template_tokens(body)
    bare = worker.template_tokens({k: v for k, v in body.items() if k != "tools"})
    if with_tools is None or bare is None:
        return None
    return max(with_tools - bare, 0)


@dataclass(frozen=True, slots=True)
class Step:
    """One call of a trial: its record and the judge's verdict on it."""

    record: CallRecord
    judgement: Judgement

    @property
    def verdict(self) -> str:
        return self.judgement.verdict


@dataclass(frozen=True, slots=True)
class Restore:
    """A slot's erase and restore and the pinned check after them (None: the server refused
    the restore, `refused` says how), with `judge_restore`'s verdict."""

    verdict: str
    reason: str
    erased: SlotTransfer | None = None
    transfer: SlotTransfer | None = None
    check: Step | None = None


class Trial:
    """Measure `head` on `worker` (module docstring): `registry` (None: nothing is read or
    written) supplies the span counted on this build and receives `finish()`'s measurement;
    `build` is one the caller just read (a keeper's, shared by its heads), else read here;
    `with_cache` brackets calls by `/cache` (default: on Halogen, the only engine with it)."""

    def __init__(
        self,
        registry: Registry | None,
        worker: Worker,
        head: Head,
        *,
        build: ServerBuild | None = None,
        with_cache: bool | None = None,
    ) -> None:
        self.registry, self.worker, self.head = registry, worker, head
        self.build = worker.server_build() if build is None else build
        self.with_cache = self.build.profile == "halogen" if with_cache is None else with_cache
        self.alignment = self.build.snapshot_align
        self.span = (
            None if registry is None else last_counted_span(registry, head, self.build.build_id)
        )
        self.last: CacheCounters | None = None  # the last call's closing `/cache` snapshot
        self._tools: int | None = None
        self._tools_read = False

    def call(
        self,
        phase: str,
        *,
        history: Sequence[Mapping[str, Any]] | None = None,
        slot: int | None = None,
    ) -> Step:
        """Send one call of the head, `max_tokens` 1 at temperature 0: with a fresh tail (never
        seen by the server), or the loop's `history` re-touched whole; pinned to `slot` when
        given; in a `calls.Bracket` opened by the trial's `last` snapshot. Raises
        WorkerError."""
        tail = fresh_tail()
        pin: dict[str, Any] = {} if slot is None else {"id_slot": slot}
        sent = tail if history is None else None
        bracket = Bracket(self.worker, self.build, with_cache=self.with_cache, before=self.last)
        evidence = self.worker.chat(
            self.head, sent, history=history, build=self.build, **WARM_PARAMS, **pin
        )[1]
        record = bracket.close(phase, sent_sha256(sent, history), evidence)
        self.last = record.after
        return Step(record, self._judge(record, tail, history))

    def _judge(
        self, record: CallRecord, tail: str, history: Sequence[Mapping[str, Any]] | None
    ) -> Judgement:
        if history is not None:  # the head and the history, re-touched: held whole or partial
            held = self.head.head_bytes + text_bytes(history)
            return judge(
                record.evidence, head_bytes=held, rest_bytes=_TURN_BYTES, alignment=self.alignment
            )
        if record.evidence.cached_tokens and not self._tools_read:
            self._tools, self._tools_read = tools_tokens(self.worker, self.build, self.head), True
        return judge(
            record.evidence,
            head_bytes=self.head.head_bytes,
            rest_bytes=len(tail.encode("utf-8")),
            alignment=self.alignment,
            measured_span=self.span,
            tools_tokens=self._tools,
        )

    def restore(self, slot: int, file: str) -> Restore:
        """Erase `slot` (the baseline), restore snapshot `file` into it, and prove it with a
        pinned check: `judge_restore`'s verdict, `restore_failed` when the server refused.
        Raises WorkerError: the worker failed outside the erase and restore requests."""
        try:
            erased = slot_action(self.worker, slot, "erase")
            transfer = slot_action(self.worker, slot, "restore", file)
        except WorkerHTTPError as exc:
            return Restore("restore_failed", f"the server refused the restore: {exc}")
        check = self.call("check", slot=slot)
        no_count = judge_unproven("the erase reply did not say what it erased")
        baseline = no_count if erased.n_tokens is None else None
        verdict, reason = judge_restore(baseline, transfer.n_tokens, check.judgement)
        return Restore(verdict, reason, erased, transfer, check)

    def changed(self) -> Judgement | None:
        """None when the server still runs the trial's build (re-read now); else `unverified`:
        the trial's numbers were counted across a change of build."""
        return judge_same_build(self.build.build_id, self.worker.server_build().build_id)

    def same_build(self, verdict: str, reason: str) -> tuple[str, str]:
        """`verdict` and `reason`, unless the build changed (`changed`): then its words."""
        changed = self.changed()
        return (verdict, reason) if changed is None else (changed.verdict, changed.reason)

    def finish(self, kind: str, body: JSONObject) -> tuple[Measurement, Path]:
        """Write one `kind` measurement of `body` under the head's system sha (a frame's body
        names the frame), bound to the trial's build; returns it and its path."""
        assert self.registry is not None  # noqa: S101 -- a trial without one records nothing
        frame = self.head.frame_sha256
        body = body if frame is None else {**body, "frame": frame}
        return record_measurement(
            self.registry, self.worker, self.build, self.head.system.sha256, kind, body
        )

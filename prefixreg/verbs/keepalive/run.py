"""`keepalive`: keep heads (prefixes or frames) resumable on a worker whose small LRU foreign
traffic churns, re-warming each before one more foreign prompt could evict it, by what the
server counts (`server.activity`): `/cache` stores (Halogen), prompts (llama.cpp's `/slots`,
else `/metrics`; an engine's Prometheus counters), else time. `KeepAlive` is the driver: it
polls, asks `.state` (the kept heads' state machine: every rule is there) what to do, sends
the re-warms and restores (`measure.calls`, `.rewarm`) and feeds back what came of them.

Invariants:
- One request at a time: polls and re-warms run in one thread (`step`); the loop's `track`
  and `touch` only tell the state machine (under its lock), and the next poll acts on it.
  A thread's `start` refuses a second; `stop` wakes it and waits for a re-warm in flight
  up to the worker's timeouts; a keeper thread never dies mute (`stopped_because`).
- Every re-warm is a measured call judged by `core.judge` (with a registry, a `keepalive`
  measurement); one that comes back cold or partial tightens the budget.
- Every interval is a finite number of seconds above 0 (`UsageError`): a NaN poll would
  spin, an infinite interval would never re-warm; so is a run's duration.
- A poll too busy to answer is skipped and the next waits longer; a 503 on a re-warm backs
  off; a refusal (an HTTP error but 503) is the head's (`KeepState.refused`); any other
  worker error is the worker's (`KeepState.worker_error`).
- A kept frame is re-warmed with its whole head, byte for byte as the loop sends it; its
  measurement is filed under the system sha, with `frame` set.
- A head with a session (`track`, `session=FILE`: the loop's latest request on it, told
  once the call returned) is re-warmed by re-touching it whole (`_call`), else with a fresh
  tail.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from prefixreg.core.errors import (
    ArgumentValueError,
    EngineBusyError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
    WorkerTimeoutError,
    check_type,
)
from prefixreg.core.frame import Frame, Head
from prefixreg.core.judge import Verdict
from prefixreg.core.prefix import Prefix
from prefixreg.registry.store import Registry
from prefixreg.server.activity import Counter, PromptCounter, StoresCounter
from prefixreg.server.slots import list_slots
from prefixreg.server.transport import check_seconds
from prefixreg.server.worker import Worker, check_body, check_worker
from prefixreg.verbs.keepalive.rewarm import (
    KeepAliveSummary,
    Rewarm,
    restore_for_keepalive,
)
from prefixreg.verbs.keepalive.session import SessionFile, why_not_kept
from prefixreg.verbs.keepalive.state import CounterKind, KeepState, Kept, PollMiss
from prefixreg.verbs.measure.budget import budget_for
from prefixreg.verbs.measure.calls import CallRecord
from prefixreg.verbs.measure.trial import Trial


class KeepAlive:
    """Keep `prefixes` (heads) resumable on `worker` (a short `timeout`: polls must not
    hang); `step()` yourself or `start()` a thread, and `track(body)` (or `touch(sha)`)
    after each own call; `session` names a file of request bodies another process appends.
    `registry` gets one measurement per re-warm and supplies a probe's survival; `on_note`
    hears a session dropped or a head given up (its re-warms kept failing). Raises
    UsageError: a wrong type or value (nothing is sent then); WorkerError: the worker did not
    answer the first reads."""

    def __init__(
        self,
        worker: Worker,
        prefixes: Sequence[Head],
        *,
        registry: Registry | None = None,
        budget: int | None = None,
        interval_s: float | None = None,
        poll_s: float = 0.5,
        on_rewarm: Callable[[Rewarm], None] | None = None,
        session: Path | str | None = None,
        copies: int = 1,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        check_type(prefixes, (list, tuple), "KeepAlive: prefixes", "a list of heads")
        if not prefixes:
            raise ArgumentValueError("KeepAlive keeps a non-empty list of heads (Registry.head)")
        for i, h in enumerate(prefixes):
            check_type(h, (Prefix, Frame), f"KeepAlive: prefixes[{i}]", "a head (Registry.head)")
        check_worker(worker, "KeepAlive: worker")
        check_type(registry, (Registry, type(None)), "KeepAlive: registry", "a Registry or None")
        check_type(session, (Path, str, type(None)), "KeepAlive: session", "a file's path")
        for ok, what in (
            (on_rewarm is None or callable(on_rewarm), "on_rewarm must be callable"),
            (on_note is None or callable(on_note), "on_note must be callable"),
            (budget is None or (type(budget) is int and budget >= 1), "budget must be >= 1"),
            (type(copies) is int and copies >= 1, "copies must be a whole number >= 1"),
        ):
            if not ok:
                raise UsageError(f"KeepAlive: {what}")
        if session is not None and (str(session) == "" or "\0" in str(session)):
            raise ArgumentValueError(f"KeepAlive: session is a file's path, not {session!r:.80}")
        self.poll_s = check_seconds("poll_s", poll_s)  # finite, above 0, at most a day
        interval_s = None if interval_s is None else check_seconds("interval_s", interval_s)
        if registry is not None:
            registry.refuse_on_mirror("record keepalive measurements")
        self.worker, self.registry, self.on_rewarm = worker, registry, on_rewarm
        self.on_note = on_note
        self.session_file = None if session is None else SessionFile(session)
        self.history: list[Rewarm] = []
        self._said: set[str] = set()  # notes told once (`_note_once`)
        self._lock = threading.Lock()  # the state machine's: `track` comes from the loop's thread
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self.build = build = worker.server_build()
        # llama.cpp's slots: each holds one prompt, so more heads than slots evict each other,
        # and as many foreign prompts as slots since a head's last use evicted it.
        # Copies (as many as the loop runs concurrent calls) are each pinned to a slot.
        # The bound is checked on the numbers before any entry is built (2**70 copies would
        # otherwise build entries until memory runs out).
        slots = list_slots(worker) if build.profile == "llamacpp" and worker.slots() else None
        self.slots = len(slots) if slots else None
        if copies > 1 and not slots:
            raise UsageError("KeepAlive: copies are kept one per slot: llama.cpp's /slots only")
        distinct = len({h.sha256 for h in prefixes})
        if self.slots is not None and distinct * copies > self.slots:
            n = f"{distinct} heads" + (f" x {copies} copies" if copies > 1 else "")
            limit = f"at most {self.slots // distinct} copies of {distinct} heads"
            raise UsageError(f"KeepAlive: {n} on {self.slots} slots evict each other ({limit})")
        counters = worker.cache() if build.profile == "halogen" else None
        self._counter: Counter | None = None
        if counters is not None and counters.stores is not None:
            self._counter = StoresCounter(worker)
            self._counter.saw(counters)
        elif build.profile != "halogen":
            # llama.cpp and the engines have no /cache but count prompts: time is the last resort.
            self._counter = PromptCounter.detect(worker, build.profile)
        # One trial per head: its span, alignment and tools read once, its re-warms judged
        # alike; the re-warms are bracketed by `/cache` when the stores are the counter.
        # `/cache` stores as the counter: its snapshots bracket the re-warms too.
        self._stores = self._counter if isinstance(self._counter, StoresCounter) else None
        self._prompts = self._counter if isinstance(self._counter, PromptCounter) else None
        stores = self._stores is not None
        self._trials = {
            h.sha256: Trial(registry, worker, h, build=build, with_cache=stores) for h in prefixes
        }
        keys: dict[str, Head] = {}  # by sha, and sha/copy for the copies after one
        for h in prefixes:
            keys |= {h.sha256 if i == 0 else f"{h.sha256}/{i}": h for i in range(copies)}
        pins = [slot.id for slot in slots or []] if copies > 1 else []
        kept = {
            key: Kept(h, self._trials[h.sha256].span, pin=pin, slot=pin)
            for n, (key, h) in enumerate(keys.items())
            for pin in [pins[n] if n < len(pins) else None]
        }
        self.budget = budget_for(
            build,
            counters,
            registry=registry,
            budget=budget,
            interval_s=interval_s,
            prompt_counter=None if self._counter is None else self._counter.source,
            kept=len(kept),
        )
        if self.budget.unit == "seconds":
            self._counter = None  # /cache without max_entries (dense): keep time instead
        unit: CounterKind = "stores" if self._stores is not None else "prompts"
        restores = registry is not None and build.profile == "llamacpp"
        self.state = KeepState(
            kept=kept,
            budget=self.budget,
            counter=None if self._counter is None else unit,
            slots=self.slots,
            poll_s=self.poll_s,
            restores=restores,
        )
        self.summary: KeepAliveSummary = self.state.summary

    def track(self, body: Mapping[str, Any]) -> str:
        """The loop just sent `body` (call it once the call returned): a kept head's request,
        which becomes its session; returns the head's sha256. Raises UsageError: `body` is not
        a request body the keeper could re-send (JSON a worker reads), or sends none of the
        kept heads unchanged (`Head.drift`)."""
        given: object = body  # callers outside the type checker pass anything
        if not isinstance(given, Mapping):
            raise UsageError(f"track() takes a request body (a mapping), not {type(given)}")
        check_body(dict(given), "track()")  # refused now, never later in the keeper's thread
        with self._lock:
            sha = self.state.track(given, time.monotonic())
        if sha is None:
            heads = [k.head for k in self.state.kept.values()]
            raise UsageError(f"track(): {why_not_kept(heads, given)}")
        self._wake.set()
        return sha

    def touch(self, sha256: str) -> None:
        """The loop just used the head `sha256`: count its survival from now on."""
        if not isinstance(sha256, str):
            raise UsageError(f"touch takes a head's sha256, not {type(sha256).__name__}")
        with self._lock:
            self.state.touch(sha256, time.monotonic())
        self._wake.set()

    def step(self) -> list[Rewarm]:
        """Poll once and re-warm every head that is due. Returns the re-warms made."""
        try:
            return self._step()
        finally:
            if self.summary.stopped_by_worker:  # the state machine said stop
                self._stop.set()

    def _step(self) -> list[Rewarm]:
        state, counter, now = self.state, self._counter, time.monotonic()
        if now < state.backoff_until:
            return []
        if self.session_file is not None:
            new, body = self.session_file.read()
            with self._lock:
                tracked = state.track(body, time.monotonic()) if new else None
            if tracked is not None:
                self._wake.set()
            elif new:
                self.summary.session_skipped += 1
                if isinstance(body, Mapping):  # said once per reason, not per poll
                    why = why_not_kept([k.head for k in state.kept.values()], body)
                    self._note_once(f"a session line was skipped: {why}")
        if counter is not None:
            got: tuple[int, bool] | PollMiss
            try:
                got = counter.read() or "empty"
            except (WorkerTimeoutError, EngineBusyError):  # a long prefill holds the queue
                got = "busy"
            except WorkerError:
                got = "error"
            if not state.polled(time.monotonic(), got):
                return []
        busy = set() if counter is None else counter.busy
        landed = set() if self._prompts is None else self._prompts.changed
        with self._lock:
            due = state.due(now, busy=busy, landed=landed)
        done: list[Rewarm] = []
        for kept in due:
            try:
                rewarm = self._rewarm(kept)
            except EngineBusyError:
                state.worker_error(time.monotonic(), backoff=True)
                break
            except WorkerHTTPError as exc:  # answered, and refused: this head's request
                with self._lock:  # its session may be dropped
                    note = state.refused(kept, exc, time.monotonic())
                if note is not None and self.on_note is not None:
                    self.on_note(note)
                break
            except WorkerError:  # unreachable or timed out: the worker's, not the head's
                state.worker_error(time.monotonic(), backoff=False)
                break
            done += [] if rewarm is None else [rewarm]
        return done

    def _note_once(self, note: str) -> None:
        """Tell `on_note` something about the session file, once per distinct note."""
        if note not in self._said:
            self._said.add(note)
            if self.on_note is not None:
                self.on_note(note)

    def _rewarm(self, kept: Kept) -> Rewarm | None:
        """Restore or re-warm the due `kept` as the state machine plans it, and record it."""
        state = self.state
        plan = state.plan(kept, time.monotonic())
        snap = None
        if plan.taken is not None and self.registry is not None:
            snap = restore_for_keepalive(self.registry, self.worker, kept.head, taken=plan.taken)
        if state.leave(kept, snap):
            return None
        verdict: Verdict
        if snap is not None and snap.check is not None:
            # The judge's `restored` (judge_restore) stands on a resumed pinned check.
            record, verdict = snap.check, "resumed"
        else:
            record, verdict = self._call(kept, plan.session)
        after, landed = self._count_after(record)
        now = time.monotonic()
        rewarm = state.rewarmed(
            kept, plan, record, verdict, now, snap=snap, after=after, landed=landed
        )
        self.history.append(rewarm)
        if self.registry is not None:
            body = rewarm.measurement_body(self.budget.to_dict())
            self._trials[kept.head.sha256].finish("keepalive", body)
        if self.on_rewarm is not None:
            self.on_rewarm(rewarm)
        return rewarm

    def _call(self, kept: Kept, session: list[dict[str, Any]] | None) -> tuple[CallRecord, Verdict]:
        """One re-warm of `kept` (in its pinned slot) and the judge's verdict: the `session`
        re-touched whole (the latest prompt again, judged against its bytes, the head's and the
        history's: one that finds only the head cached is partial), else the head with a
        fresh tail (against its span measured on this build)."""
        trial = self._trials[kept.head.sha256]
        if self._stores is not None:
            trial.last = self._stores.last  # the latest poll's snapshot opens the call's window
        step = trial.call("keepalive", history=session, slot=kept.pin)
        return step.record, step.judgement.verdict

    def _count_after(self, record: CallRecord) -> tuple[int | None, set[int]]:
        """The counter after a re-warm and the slots it saw change: `/cache`'s closing
        snapshot taken as the latest, else a read of the prompts (None: not counted)."""
        after = record.after
        if self._stores is not None:
            if after is None or after.stores is None:
                return None, set()
            return self._stores.saw(after)[0], set()
        prompts = self._prompts
        try:
            got = None if prompts is None else prompts.read()
        except WorkerError:
            got = None  # the next poll sees our prompt and lands on since 0
        return (None, set()) if got is None or prompts is None else (got[0], prompts.changed)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s` (finite, above 0) or too many errors."""
        given: object = duration_s  # callers outside the type checker pass anything
        span = given if isinstance(given, int | float) and not isinstance(given, bool) else math.nan
        if given is not None and not (math.isfinite(span) and span > 0):
            raise UsageError(
                f"duration_s must be a finite number of seconds above 0, not {given!r}"
            )
        end = None if given is None else time.monotonic() + span
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 -- a keeper thread must never die mute
                # Not the worker's doing (a record not written, a failing callback): say why.
                self.summary.stopped_because = f"{type(exc).__name__}: {exc}"
                self._stop.set()
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            self._wake.wait(self.poll_s if left is None else min(self.poll_s, left))
            self._wake.clear()
        return self.summary

    def start(self) -> Self:
        """Run in a daemon thread (the loop keeps its own thread)."""
        if self._thread is not None:
            raise UsageError("this keeper is already running: one thread, one request at a time")
        self._thread = threading.Thread(target=self.run, name="prefixreg-keepalive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> KeepAliveSummary:
        """Stop the thread (if any), waiting for a re-warm in flight, and return the summary."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.worker.read_timeout + self.worker.timeout)
        return self.summary

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

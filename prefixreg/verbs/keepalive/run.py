"""`keepalive`: keep heads (prefixes or frames) resumable on a worker whose small LRU foreign
traffic churns, re-warming each before one more foreign prompt could evict it, by what the
server counts (`server.activity`): `/cache` stores (Halogen), prompts (llama.cpp's `/slots`,
else `/metrics`; an engine's Prometheus counters), else time. The budget is `measure.budget`'s;
the records and the restore of a head lost to a llama.cpp restart or eviction, `.rewarm`'s.

Invariants:
- One request at a time: polls and re-warms run in one thread (`step`); the loop's `touch`
  only marks a head as just used, and the next poll takes the baseline.
- Every re-warm is a measured call judged by `core.judge` (with a registry, a `keepalive`
  measurement); one that comes back cold or partial tightens the budget.
- Every interval is a finite number of seconds above 0 (`UsageError`): a NaN poll would
  spin, an infinite interval would never re-warm.
- A poll too busy to answer is skipped and the next waits longer; a 503 on a re-warm backs
  off exponentially; five worker errors with no answered poll between them stop the keeper,
  and so does anything else that goes wrong in its thread (`stopped_because`).
- A head whose re-warm the worker refused (an HTTP error but 503: its request's fault, not
  counted as a worker error above) is not re-warmed again before a back-off that doubles
  with its refusals in a row (answered polls do not end that streak; capped like the 503's);
  after `session.MAX_FAILURES` its session is dropped, then the head given up (`ks.failed`),
  each said once (`on_note`, the summary's `dropped`); with every head given up it stops.
- A first warm (a head never used nor warmed) has no `since`: it is cold by nature, so it
  neither tightens the budget nor counts in the cost rule.
- Only foreign activity counts: a head is never due before a foreign prompt has stored (or
  run); the keeper's re-warms and the loop's calls (tracked or touched) are taken off the
  other kept heads' counts, and each stores budget is reduced by the entries they hold instead.
- A kept frame is re-warmed with its whole head, byte for byte as the loop sends it; its
  measurement is filed under the system sha, with `frame` set.
- A head with a session (`track`, `session=FILE`: the loop's latest request on it, told
  once the call returned) is re-warmed by re-touching it whole (`.session`), else with a
  fresh tail. Never slower: re-warms are sent only while `session.rewarm_pays` (they keep
  more tokens warm than they prefill); else the keeper backs off and says why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import (
    ArgumentValueError,
    EngineBusyError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
    WorkerTimeoutError,
)
from prefixreg.core.frame import Frame, Head
from prefixreg.core.judge import Verdict, judge_burst
from prefixreg.core.prefix import Prefix
from prefixreg.registry.store import Registry
from prefixreg.server.activity import Counter, PromptCounter, StoresCounter
from prefixreg.server.slots import list_slots
from prefixreg.server.transport import check_seconds
from prefixreg.server.worker import Worker, check_body
from prefixreg.verbs.keepalive import session as ks
from prefixreg.verbs.keepalive.rewarm import KeepAliveSummary, Rewarm, restore_for_keepalive
from prefixreg.verbs.keepalive.thread import Stepper
from prefixreg.verbs.measure.budget import budget_for
from prefixreg.verbs.measure.calls import last_counted_span, record_measurement

MAX_ERRORS: Final = 5
MAX_BACKOFF_S: Final = 30.0


class KeepAlive(Stepper):
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
        heads: object = prefixes
        if not isinstance(heads, list | tuple) or not heads:
            raise UsageError("KeepAlive keeps a non-empty list of heads (Registry.head)")
        for ok, what in (
            (isinstance(worker, Worker), "worker must be a Worker"),
            (all(isinstance(h, Prefix | Frame) for h in heads), "heads are Prefix or Frame"),
            (registry is None or isinstance(registry, Registry), "registry must be a Registry"),
            (budget is None or (type(budget) is int and budget >= 1), "budget must be >= 1"),
            (on_rewarm is None or callable(on_rewarm), "on_rewarm must be callable"),
            (on_note is None or callable(on_note), "on_note must be callable"),
            (session is None or isinstance(session, Path | str), "session is a file's path"),
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
        self.summary, self.gate = KeepAliveSummary(), ks.CostGate()
        self.session_file = None if session is None else ks.SessionFile(session)
        self.history: list[Rewarm] = []
        self._touched: set[str] = set()
        self._said: set[str] = set()  # notes told once (`_note_once`)
        self._lock = threading.Lock()
        super().__init__()  # the thread's events: `thread.Stepper`
        self._errors_in_row = self._poll_misses = 0  # misses: polls too busy to answer
        self._backoff_until, self._told = 0.0, False
        self._polled = False  # a poll answered: the next one counts what landed in between
        self._landed: float | None = None
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
        self._kept: dict[str, ks.Kept] = {}  # by sha, and sha/copy for the copies after one
        for h in prefixes:
            span = None if registry is None else last_counted_span(registry, h, build.build_id)
            for i in range(copies):
                self._kept[h.sha256 if i == 0 else f"{h.sha256}/{i}"] = ks.Kept(h, span)
        counters = worker.cache() if build.profile == "halogen" else None
        self._counter: Counter | None = None
        if counters is not None and counters.stores is not None:
            self._counter = StoresCounter(worker)
            self._counter.saw(counters)
        elif build.profile != "halogen":
            # llama.cpp and the engines have no /cache but count prompts: time is the last resort.
            self._counter = PromptCounter.detect(worker, build.profile)
        for kept, slot in zip(self._kept.values(), slots or [], strict=False):
            kept.pin = kept.slot = slot.id if copies > 1 else None
        self.budget = budget_for(
            build,
            counters,
            registry=registry,
            budget=budget,
            interval_s=interval_s,
            prompt_counter=None if self._counter is None else self._counter.source,
            kept=len(self._kept),
        )
        if self.budget.unit == "seconds":
            self._counter = None  # /cache without max_entries (dense): keep time instead

    def track(self, body: Mapping[str, Any]) -> str:
        """The loop just sent `body` (call it once the call returned): a kept head's request,
        which becomes its session; returns the head's sha256. Raises UsageError: `body` is not
        a request body the keeper could re-send (JSON a worker reads), or sends none of the
        kept heads unchanged (`Head.drift`)."""
        given: object = body  # callers outside the type checker pass anything
        if not isinstance(given, Mapping):
            raise UsageError(f"track() takes a request body (a mapping), not {type(given)}")
        check_body(dict(given), "track()")  # refused now, never later in the keeper's thread
        sha = self._track(given)
        if sha is None:
            heads = [k.head for k in self._kept.values()]
            raise UsageError(f"track(): {ks.why_not_kept(heads, given)}")
        return sha

    def _track(self, body: object) -> str | None:
        for kept in sorted(self._kept.values(), key=lambda k: k.head.kind != "frame"):
            if (history := ks.session_of(kept.head, body)) is not None:
                with self._lock:
                    kept.session = history or None
                self.touch(kept.head.sha256)
                return kept.head.sha256
        return None

    def touch(self, sha256: str) -> None:
        """The loop just used the head `sha256`: count its survival from now on."""
        if not isinstance(sha256, str):
            raise UsageError(f"touch takes a head's sha256, not {type(sha256).__name__}")
        with self._lock:
            for kept in self._kept.values():
                if kept.head.sha256 == sha256:  # every copy of it
                    self._touched.add(sha256)
                    self._told = True  # the loop tells its calls: the others are foreign
                    kept.last_used = time.monotonic()
        self._wake.set()

    def _read(self, counter: Counter) -> float | None:
        """The counter now (None: skip this round); a restart forgets every baseline."""
        self.summary.polls += 1
        got = None
        try:
            got = counter.read()
        except (WorkerTimeoutError, EngineBusyError):  # a long prefill holds the queue:
            self._poll_misses += 1  # wait longer each time, so polls cannot pile up
            self._backoff(self._poll_misses)
        except WorkerError:
            self._error(backoff=True)
        if got is None:
            self.summary.skipped_polls += 1
            return None
        self._errors_in_row = self._poll_misses = 0  # an answered poll ends both streaks
        total, restarted = got
        for kept in self._kept.values() if restarted else ():  # nothing is cached now
            kept.baseline, kept.slot, kept.lost, kept.left = None, kept.pin, True, None
        return total

    def _since(self, kept: ks.Kept, now: float) -> float | None:
        """The foreign activity since `kept` was last used; None: never used nor warmed."""
        if self._counter is None:
            return None if kept.last_used is None else now - kept.last_used
        return None if kept.baseline is None else self._counter.total - kept.baseline

    def _due(self, now: float) -> list[ks.Kept]:
        with self._lock:
            touched, self._touched = self._touched, set()
        due = []
        busy = self._counter.busy if self._counter is not None else set()
        landed = self._counter.changed if isinstance(self._counter, PromptCounter) else set()
        for kept in self._kept.values():  # the loop's uses first: none is foreign
            sha = kept.head.sha256
            if sha in touched and kept.slot in busy:  # the loop's call still ends there:
                with self._lock:  # take its baseline at a later poll, once the slot has
                    self._touched.add(sha)  # counted it (no wake: that would poll nonstop)
            elif sha in touched and self._counter is not None:
                kept.baseline, kept.evicted, kept.left = self._counter.total, False, None
                ks.discount(kept, self._kept.values(), float(self.budget.per_request))
                if len(landed) == 1 and kept.pin is None:  # where the loop's call ended
                    kept.slot = next(iter(landed))
        gone = max(self.slots or 0, self.budget.limit + 1)
        total = self._counter.total if self._counter is not None else 0
        for kept in self._kept.values():
            if kept.left is not None and total - kept.left >= gone:  # as long again as it took
                kept.left, kept.evicted = None, False  # go: re-warm it (now due, not gone)
                kept.baseline = total - self.budget.limit
            if kept.left is not None or (kept.slot is not None and kept.slot in busy):
                continue  # left to the loop; or its slot serves a prompt (likely the loop's):
            since = self._since(kept, now)  # a re-warm now would go cold in another slot
            # Evicted (llama.cpp): a foreign prompt ended in its slot (a loop that tells its calls),
            # or more landed than it survives: restore it (with a snapshot), never re-prefill it.
            taken = self._told and kept.slot in landed and kept.head.sha256 not in touched
            if self.slots and self.budget.unit == "prompts" and (taken or (since or 0) >= gone):
                kept.evicted = True
            if since is None or self.budget.due(since):
                due.append(kept)
        return due

    def step(self) -> list[Rewarm]:
        """Poll once and re-warm every head that is due. Returns the re-warms made."""
        now = time.monotonic()
        if now < self._backoff_until:
            return []
        if self.session_file is not None:
            new, body = self.session_file.read()
            if new and self._track(body) is None:
                self.summary.session_skipped += 1
                if isinstance(body, Mapping):  # said once per reason, not per poll
                    why = ks.why_not_kept([k.head for k in self._kept.values()], body)
                    self._note_once(f"a session line was skipped: {why}")
        counter = self._counter
        before = counter.total if counter is not None and self._polled else None
        if counter is not None and self._read(counter) is None:
            return []
        self._polled = counter is not None
        self._landed = None if before is None or counter is None else counter.total - before
        done, due = [], self._due(now)
        if self._counter is not None and self._counter.busy:
            due = []  # llama.cpp: a prompt runs; a re-warm now would race it. Next poll.
        due = [k for k in due if k.given_up is None and now >= k.retry_at]
        allowed = self.gate.allow(now) if due else 0
        for kept in due[:allowed]:
            try:
                rewarm = self._rewarm(kept, self._since(kept, time.monotonic()))
                done += [] if rewarm is None else [rewarm]
            except EngineBusyError:
                self._error(backoff=True)
                break
            except WorkerHTTPError as exc:  # answered, and refused: this head's request
                self.summary.errors += 1
                self._failed(kept, exc)
                break
            except WorkerError:  # unreachable or timed out: the worker's, not the head's
                self._error(backoff=False)
                break
            self._errors_in_row = kept.failures = 0
        self.summary.backoffs, self.summary.backoff_reason = self.gate.backoffs, self.gate.why
        return done

    def _backoff(self, n: int) -> None:
        self._backoff_until = time.monotonic() + min(MAX_BACKOFF_S, self.poll_s * 2**n)

    def _error(self, *, backoff: bool) -> None:
        self.summary.errors += 1
        self._errors_in_row += 1
        if backoff:
            self._backoff(self._errors_in_row)
        if self._errors_in_row >= MAX_ERRORS and self.summary.stopped_because is None:
            self.summary.stopped_because = f"{self._errors_in_row} worker errors in a row"
            self.summary.stopped_by_worker = True
            self._stop.set()

    def _note_once(self, note: str) -> None:
        """Tell `on_note` something about the session file, once per distinct note."""
        if note not in self._said:
            self._said.add(note)
            if self.on_note is not None:
                self.on_note(note)

    def _failed(self, kept: ks.Kept, exc: WorkerError) -> None:
        """The worker refused a re-warm of `kept` (`ks.failed`): back off, drop, give up."""
        with self._lock:  # its session may be dropped: `track` sets it from the loop's thread
            note = ks.failed(kept, exc, lambda n: min(MAX_BACKOFF_S, self.poll_s * 2**n))
        if note is None:
            return
        self.summary.dropped.append(note)
        if all(k.given_up is not None for k in self._kept.values()):
            self.summary.stopped_because = "every kept head given up (its re-warms kept failing)"
            self.summary.stopped_by_worker = True
            self._stop.set()
        if self.on_note is not None:
            self.on_note(note)

    def _rewarm(self, kept: ks.Kept, since: float | None) -> Rewarm | None:
        counter, head, snap = self._counter, kept.head, None
        first = since is None or kept.lost or kept.last_used is None  # cold by nature
        lost = kept.lost or kept.evicted
        if lost and self.registry is not None and self.build.profile == "llamacpp":
            held = [k for k in self._kept.values() if k is not kept and not (k.lost or k.evicted)]
            held += [kept] if kept.evicted and not kept.lost else []  # it may be the loop's
            taken = {k.slot for k in held if k.slot is not None}
            snap = restore_for_keepalive(self.registry, self.worker, head, taken=taken)
        verdict: Verdict
        check = None if snap is None else snap.check
        if kept.evicted and check is None and not ks.rewarm_pays([], evicted=True)[0]:
            kept.left = counter.total if counter is not None else 0
            self.summary.left_to_loop += 1  # re-prefilled, it would save what it costs
            self.summary.restore_misses += snap is not None
            return None
        if check is not None:
            # The judge's `restored` (judge_restore) stands on a resumed pinned check.
            record, verdict = check, "resumed"
        else:
            align = self.build.snapshot_align
            record, verdict = ks.rewarm_call(
                self.worker, self.build, kept, counter, alignment=align
            )
        kept.lost, kept.evicted, kept.last_used = False, False, time.monotonic()
        if counter is not None:
            ks.rebase(kept, self._kept.values(), counter, record, self.budget.per_request)
        survives, unit = self.budget.limit, self.budget.unit  # before a miss tightens it
        change = self.budget.learn(record.before, record.after, record.interleaved, verdict, since)
        landed = self._landed
        if judge_burst(verdict, first=bool(first), landed=landed, survives=survives, unit=unit):
            self.summary.burst(landed or 0.0, survives, unit)
        if change is not None:
            self.summary.budget_changes.append(change)
        ev = record.evidence
        if not first and verdict != "unverified" and ev.prompt_tokens is not None:
            cached = ev.cached_tokens or 0
            kept_tokens = cached if verdict == "resumed" else 0
            spent = ev.prompt_tokens - cached
            self.gate.saw(kept_tokens, spent, time.monotonic(), tightened=change is not None)
        frame = head.sha256 if isinstance(head, Frame) else None
        report = None if snap is None else snap.to_dict()
        b = self.budget
        rewarm = Rewarm(head.system.sha256, since, verdict, record, b.limit, b.unit, frame, report)
        self.summary.count(rewarm, snap, session=kept.session is not None, first=bool(first))
        self.history.append(rewarm)
        if self.registry is not None:
            body = rewarm.measurement_body(b.to_dict())
            record_measurement(
                self.registry, self.worker, self.build, rewarm.sha256, "keepalive", body
            )
        if self.on_rewarm is not None:
            self.on_rewarm(rewarm)
        return rewarm

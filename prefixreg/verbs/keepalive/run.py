"""`keepalive`: keep heads (prefixes or frames) resumable on a worker whose small LRU
foreign traffic churns.

On a server with `/cache` (Halogen) it counts `stores` since each head was last used and
re-warms the head before one more foreign prompt could evict it; on llama.cpp (no `/cache`)
it counts *prompts*, from `/slots`, else `/metrics` (`prefixreg.server.activity`); other
servers are kept warm on a time interval. The budget policy is in
`prefixreg.verbs.measure.budget`, the records of the work in `.rewarm`. With a registry, a
prefix lost to a llama.cpp restart comes back from its proven KV snapshot for the current
build instead of a re-prefill (`.restore`).

Invariants:
- One request at a time: polls and re-warms run in one thread (`step`); the loop's `touch`
  only marks a head as just used, and the next poll takes the baseline.
- Every re-warm is a measured call judged by `core.judge` (with a registry, a `keepalive`
  measurement); one that comes back cold or partial proves the budget too large, and the
  budget tightens to what was observed.
- Every interval is a finite number of seconds above 0 (`UsageError` otherwise): a NaN
  poll would spin, an infinite interval would never re-warm.
- A poll the server is too busy to answer is skipped, and the next one waits longer; a 503
  on a re-warm backs off exponentially; five worker errors with no answered poll between
  them stop the keeper, and so does anything else that goes wrong in its thread
  (`summary.stopped_because` says why, `alive` turns false).
- Only foreign activity counts: a head is never due before a foreign prompt has stored (or
  run), and the stores of the keeper's own re-warms are taken off the other kept heads'
  counts; instead, each one's stores budget is reduced by the entries the others hold.
- A kept frame is re-warmed with its whole head, byte for byte as the loop sends it; its
  measurement is filed under the system sha, with `frame` set.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from prefixreg.core.errors import EngineBusyError, UsageError, WorkerError, WorkerTimeoutError
from prefixreg.core.frame import Frame, Head
from prefixreg.core.judge import Verdict
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.server.activity import Counter, PromptCounter, StoresCounter
from prefixreg.server.transport import check_seconds
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.restore import SnapshotRewarm, restore_for_keepalive
from prefixreg.verbs.keepalive.rewarm import KeepAliveSummary, Rewarm
from prefixreg.verbs.measure.budget import budget_for
from prefixreg.verbs.measure.calls import (
    CallRecord,
    judge_check,
    measured_call,
    measured_span,
    record_measurement,
)

MAX_ERRORS: Final = 5
MAX_BACKOFF_S: Final = 30.0


def positive_seconds(name: str, value: object) -> float:
    """`value` as a finite number of seconds above 0, else a `UsageError`."""
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if real and isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return float(value)
    raise UsageError(f"{name} must be a finite number of seconds above 0, not {value!r}")


@dataclass(slots=True)
class _Kept:
    prefix: Head  # a frame: its whole head is re-warmed
    baseline: float | None = None  # the counter when last used; None: never warmed
    last_used: float = 0.0
    slot: int | None = None  # llama.cpp: the slot our last re-warm landed in
    lost: bool = False  # the server restarted since this head was last warmed
    span: int | None = None  # the head's span as a resumed warm measured it on this build


class KeepAlive:
    """Keep `prefixes` (heads: `Prefix` or `Frame`) resumable on `worker`. Run `step()`
    yourself, or `start()` a thread.

    The worker should have a short `timeout` (polls must not hang); `touch(sha)` after the
    loop's own call resets that head's count. `registry` (optional) receives one
    measurement per re-warm and supplies a probe's survival as the budget. `alive` says
    whether the thread still runs; `summary.stopped_because` says why it stopped.

    Raises:
        UsageError: a wrong type or value (nothing is sent then).
        WorkerError: the worker did not answer the first reads.
    """

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
    ) -> None:
        heads: object = prefixes
        if not isinstance(worker, Worker):
            raise UsageError(f"KeepAlive takes a Worker, not {type(worker).__name__}")
        if not isinstance(heads, list | tuple) or not heads:
            raise UsageError("KeepAlive takes a non-empty list of heads (Registry.head)")
        if not all(isinstance(h, Prefix | Frame) for h in heads):
            raise UsageError("KeepAlive keeps Prefix or Frame heads (Registry.head), not refs")
        if registry is not None and not isinstance(registry, Registry):
            raise UsageError(f"registry must be a Registry, not {type(registry).__name__}")
        if budget is not None and (type(budget) is not int or budget < 1):
            raise UsageError(f"budget must be a whole number >= 1, not {budget!r}")
        if on_rewarm is not None and not callable(on_rewarm):
            raise UsageError("on_rewarm must be callable")
        self.poll_s = check_seconds("poll_s", poll_s)  # finite, above 0, at most a day
        if interval_s is not None:
            interval_s = check_seconds("interval_s", interval_s)
        if registry is not None:
            registry.refuse_on_mirror("record keepalive measurements")
        self.worker = worker
        self.registry = registry
        self.on_rewarm = on_rewarm
        self.summary = KeepAliveSummary()
        self.history: list[Rewarm] = []
        self._kept = {p.sha256: _Kept(p) for p in prefixes}
        self._touched: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors_in_row = 0
        self._poll_misses = 0  # polls in a row the server was too busy to answer
        self._backoff_until = 0.0
        self.build = worker.server_build()
        self._restore = registry is not None and self.build.profile == "llamacpp"
        counters = worker.cache() if self.build.profile == "halogen" else None
        self._counter: Counter | None = None
        if counters is not None and counters.stores is not None:
            self._counter = StoresCounter(worker)
            self._counter.saw(counters)
        elif self.build.profile == "llamacpp":
            # llama.cpp has no /cache but counts its tasks: time is only the last resort.
            self._counter = PromptCounter.detect(worker)
        self.budget = budget_for(
            self.build,
            counters,
            registry=registry,
            budget=budget,
            interval_s=interval_s,
            prompt_counter=None if self._counter is None else self._counter.source,
            kept=len(self._kept),
        )
        if self.budget.unit == "seconds":
            self._counter = None  # /cache without max_entries (dense): keep time instead
        for kept in self._kept.values():
            if registry is not None:
                kept.span = measured_span(registry, kept.prefix, self.build.build_id)

    # -- the loop's side -----------------------------------------------------------------

    def touch(self, sha256: str) -> None:
        """The loop just used the head `sha256`: count its survival from now on."""
        if not isinstance(sha256, str):
            raise UsageError(f"touch takes a head's sha256, not {type(sha256).__name__}")
        with self._lock:
            if sha256 in self._kept:
                self._touched.add(sha256)
                self._kept[sha256].last_used = time.monotonic()
        self._wake.set()

    # -- one round -----------------------------------------------------------------------

    def _read(self, counter: Counter) -> float | None:
        """The counter now (None: skip this round); a restart forgets every baseline."""
        self.summary.polls += 1
        try:
            got = counter.read()
        except (WorkerTimeoutError, EngineBusyError):
            # Too busy to answer (a long prefill holds the queue): wait longer each time, so
            # abandoned polls cannot pile up behind it.
            self.summary.skipped_polls += 1
            self._poll_misses += 1
            self._backoff(self._poll_misses)
            return None
        except WorkerError:
            self.summary.skipped_polls += 1
            self._error(backoff=True)
            return None
        if got is None:
            self.summary.skipped_polls += 1
            return None
        self._errors_in_row = self._poll_misses = 0  # an answered poll ends both streaks
        total, restarted = got
        if restarted:
            for kept in self._kept.values():  # the server restarted: nothing is cached
                kept.baseline, kept.slot, kept.lost = None, None, True
        return total

    def _since(self, kept: _Kept, now: float) -> float | None:
        if self._counter is None:
            return now - kept.last_used
        return None if kept.baseline is None else self._counter.total - kept.baseline

    def _due(self, now: float) -> list[_Kept]:
        with self._lock:
            touched, self._touched = self._touched, set()
        due = []
        busy = self._counter.busy if self._counter is not None else set()
        for sha, kept in self._kept.items():
            if sha in touched and self._counter is not None:
                kept.baseline = self._counter.total
            if kept.slot is not None and kept.slot in busy:
                # Its slot is serving a prompt right now, most likely the loop's own call
                # on this prefix: a re-warm now would find the slot taken and prefill the
                # whole prefix cold in another one. Decide on the next poll.
                continue
            since = self._since(kept, now)
            if since is None or self.budget.due(since):
                due.append(kept)
        return due

    def step(self) -> list[Rewarm]:
        """Poll once and re-warm every prefix that is due. Returns the re-warms made."""
        now = time.monotonic()
        if now < self._backoff_until:
            return []
        if self._counter is not None and self._read(self._counter) is None:
            return []
        done = []
        for kept in self._due(now):
            try:
                rewarm = self._rewarm(kept, self._since(kept, time.monotonic()))
            except EngineBusyError:
                self._error(backoff=True)
                break
            except WorkerError:
                self._error(backoff=False)
                break
            self._errors_in_row = 0
            done.append(rewarm)
        return done

    def _backoff(self, n: int) -> None:
        delay = min(MAX_BACKOFF_S, self.poll_s * 2**n)
        self._backoff_until = time.monotonic() + delay

    def _error(self, *, backoff: bool) -> None:
        self.summary.errors += 1
        self._errors_in_row += 1
        if backoff:
            self._backoff(self._errors_in_row)
        if self._errors_in_row >= MAX_ERRORS:
            self.summary.stopped_because = f"{self._errors_in_row} worker errors in a row"
            self.summary.stopped_by_worker = True
            self._stop.set()

    def _from_snapshot(self, kept: _Kept) -> SnapshotRewarm | None:
        """A prefix lost to a restart, restored from its snapshot (None: not tried)."""
        if not (kept.lost and self._restore and self.registry is not None):
            return None
        if isinstance(kept.prefix, Frame):
            return None  # a snapshot holds a bare prefix's state, not a frame's whole head
        taken = {k.slot for k in self._kept.values() if k.slot is not None and not k.lost}
        return restore_for_keepalive(self.registry, self.worker, kept.prefix, taken=taken)

    def _rewarm(self, kept: _Kept, since: float | None) -> Rewarm:
        counter = self._counter
        stores = counter if isinstance(counter, StoresCounter) else None
        head = kept.prefix
        snap = self._from_snapshot(kept)
        verdict: Verdict
        if snap is not None and snap.check is not None:
            # The judge's `restored` (judge_restore) stands on a resumed pinned check.
            record, verdict = snap.check, "resumed"
        else:
            tail = fresh_tail()
            record = measured_call(
                self.worker,
                head,
                phase="keepalive",
                tail=tail,
                with_cache=stores is not None,
                before=None if stores is None else stores.last,
            )
            align = self.build.snapshot_align
            verdict = judge_check(
                record.evidence, head, tail=tail, alignment=align, measured=kept.span
            ).verdict
        kept.lost = False
        kept.last_used = time.monotonic()
        if counter is not None:
            self._rebase(kept, counter, record)
        self._learn(record, verdict, since)
        frame = head.sha256 if isinstance(head, Frame) else None
        report = None if snap is None else snap.to_dict()
        b = self.budget
        rewarm = Rewarm(head.system.sha256, since, verdict, record, b.limit, b.unit, frame, report)
        if snap is not None:
            self.summary.saw_restore(
                snap.restored, snap.restore_s, snap.prefill_tokens, snap.prefill_s
            )
        self.summary.count(rewarm)
        self.history.append(rewarm)
        self._record(rewarm)
        if self.on_rewarm is not None:
            self.on_rewarm(rewarm)
        return rewarm

    def _rebase(self, kept: _Kept, counter: Counter, record: CallRecord) -> None:
        """After a re-warm: this prefix counts from now, and the counter units our own
        request added are not foreign activity for the other kept prefixes (their entries
        were already allowed for in the budget; counting them too would make the keeper
        re-warm its prefixes in turn forever)."""
        before = counter.total
        if isinstance(counter, StoresCounter):
            own = float(self.budget.per_request)
            after = record.after
            if after is not None and after.stores is not None:
                b = record.before
                if b is not None and b.stores is not None and not record.interleaved:
                    own = float(after.stores - b.stores)
                counter.saw(after)
                kept.baseline = counter.total
            else:
                # No closing snapshot: count from what was there plus our own stores, so
                # the next poll sees only what others stored since.
                kept.baseline = before + own
        else:
            own = 1.0
            # Our own prompt is the one change we expect; any other prompt that landed
            # during the re-warm is counted against the prefix (which of the two slots is
            # the least recently used is then unknown: assume the worse).
            kept.baseline = before + 1
            try:
                got = counter.read()
            except WorkerError:
                got = None  # the next poll sees our prompt and lands on since 0
            if got is not None:
                kept.baseline = min(got[0], before + 1)
                landed = counter.changed
                kept.slot = next(iter(landed)) if len(landed) == 1 else None
        for other in self._kept.values():
            if other is not kept and other.baseline is not None:
                other.baseline += own

    def _learn(self, record: CallRecord, verdict: Verdict, since: float | None) -> None:
        """Update stores-per-request from our own window; tighten the budget after a miss."""
        b = self.budget
        before = None if record.before is None else record.before.stores
        after = None if record.after is None else record.after.stores
        clean = b.unit == "stores" and not record.interleaved
        if clean and before is not None and after is not None and after > before:
            b.per_request = after - before
        if since is None or verdict not in ("cold", "partial"):
            return
        # Gone after `since` (a lower bound in prompts, exact in stores and seconds): it
        # survives less, by an unknown amount. Halve: a few misses converge from any
        # overestimate, and a resumed re-warm is cheap while a cold one is a full prefill.
        floor = b.per_request if b.unit == "stores" else (1 if b.unit == "prompts" else 0.0)
        tighter = max(floor, since // 2 if b.unit != "seconds" else since / 2)
        if tighter < b.limit:
            b.source = "tightened after a cold re-warm"
            self.summary.budget_changes.append(
                f"budget {b.limit:g} -> {tighter:g} {b.unit}: a re-warm after {since:g} "
                f"{b.unit} came back {verdict}"
            )
            b.limit = tighter

    def _record(self, rewarm: Rewarm) -> None:
        if self.registry is not None:
            body = rewarm.measurement_body(self.budget.to_dict())
            record_measurement(
                self.registry, self.worker, self.build, rewarm.sha256, "keepalive", body
            )

    # -- running -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the keeper's thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s`, or too many errors."""
        if duration_s is not None:
            duration_s = positive_seconds("duration_s", duration_s)
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 -- a keeper thread must never die mute
                # Not the worker's doing (a measurement that cannot be written, a failing
                # callback): stop and say why rather than let the thread die with a traceback.
                self.summary.stopped_because = f"{type(exc).__name__}: {exc}"
                self._stop.set()
                break
            if end is not None and time.monotonic() >= end:
                break
            wait = (
                self.poll_s if end is None else min(self.poll_s, max(0.0, end - time.monotonic()))
            )
            self._wake.wait(wait)
            self._wake.clear()
        return self.summary

    def start(self) -> KeepAlive:
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

    def __enter__(self) -> KeepAlive:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

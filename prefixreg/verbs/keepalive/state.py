"""The keeper's state machine: what it knows of each kept head and every rule that moves it.
Pure: it sends nothing and reads no clock; each transition takes what was observed (a poll's
count, a re-warm's record and verdict, a refusal) and the time, moves the heads and says what
to do. `KeepAlive` polls, asks, does the I/O and feeds the outcome back.

A kept head is (`KeepState.status`) `fresh` (never used nor warmed) or `lost` (the server
restarted since): due, a first warm, cold by nature (it neither tightens the budget nor counts
in the cost rule); `warm`, then `due` once one more foreign prompt could evict it
(`Budget.due`); `evicted` (llama.cpp, counting prompts: a foreign prompt ended in its slot, or
as many landed as it survives); `left` to the loop (evicted, not restored: never re-prefilled)
until as much again has landed; `backing off` (the worker refused its re-warm); `given up`.
A lost or evicted head is restored from its snapshot first where `restores`. A re-warm makes
any of them `warm`; a session (`track`) is re-touched whole by its re-warms.

Invariants:
- Only foreign activity counts: a head is never due before a foreign prompt has stored (or
  run); the keeper's re-warms and the loop's calls (tracked or touched) are taken off the
  other kept heads' counts (`_discount`). A restart forgets every baseline.
- Never slower (`rewarm_pays`, pure): re-warms go on while the tokens they keep warm exceed
  the prefill they spend over the last `WINDOW`; else none for `BACKOFF_S` (doubling), then
  one probe: kept, and the rule starts afresh from it. Every back-off is counted and said.
- Worker trouble is the worker's, never a head's: a poll too busy to answer waits longer each
  time; `MAX_ERRORS` worker errors with no answered poll between them stop the keeper, and so
  does every head given up (`summary.stopped_by_worker`). A refusal (an HTTP error but 503) is
  the head's: it backs off doubling with its refusals in a row (answered polls do not end that
  streak), capped like the worker's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from prefixreg.core.frame import Head
from prefixreg.core.judge import Verdict, judge_burst
from prefixreg.verbs.keepalive.rewarm import KeepAliveSummary, Rewarm, SnapshotRewarm
from prefixreg.verbs.keepalive.session import session_of
from prefixreg.verbs.measure.budget import Budget
from prefixreg.verbs.measure.calls import CallRecord

# The re-warms the cost rule looks back on, and how many it needs before it may say no.
WINDOW: Final = 6
MIN_OUTCOMES: Final = 3
# The first cost back-off, in seconds; each probe that is not kept doubles it, up to the cap.
BACKOFF_S: Final = 10.0
MAX_BACKOFF_S: Final = 600.0
# Refusals of one head in a row before its session is dropped (then the head given up); worker
# errors in a row that stop the keeper; the cap of both back-offs (`poll_s * 2**n` seconds).
MAX_FAILURES: Final = 5
MAX_ERRORS: Final = 5
MAX_WAIT_S: Final = 30.0

CounterKind = Literal["stores", "prompts"]
PollMiss = Literal["busy", "error", "empty"]
Status = Literal["fresh", "lost", "warm", "due", "evicted", "left", "backing off", "given up"]


@dataclass(slots=True)
class Kept:
    """What the keeper knows of one kept head: its span, counts, slot and session."""

    head: Head  # a frame: its whole head is re-warmed
    span: int | None  # the head's span as a resumed warm measured it on this build
    baseline: float | None = None  # the counter when last used; None: never warmed
    last_used: float | None = None  # monotonic seconds at its last use; None: never used
    slot: int | None = None  # llama.cpp: the slot our last re-warm landed in
    lost: bool = False  # the server restarted since this head was last warmed
    evicted: bool = False  # as many foreign prompts as slots landed since its last use
    left: float | None = None  # evicted, not restored: left to the loop since this count
    session: list[dict[str, Any]] | None = None  # the loop's latest history on this head
    pin: int | None = None  # llama.cpp: the slot this copy is kept in (one per copy)
    failures: int = 0  # re-warms failed in a row (answered polls do not end the streak)
    retry_at: float = 0.0  # backing off after a failure: not re-warmed before (monotonic)
    given_up: str | None = None  # why it is no longer kept (its re-warms kept failing)


@dataclass(frozen=True, slots=True)
class Plan:
    """A due head's re-warm: the activity `since` its last use, whether it is a `first` warm,
    the `session` to re-touch (None: a fresh tail); restore first into a slot not `taken`."""

    since: float | None
    first: bool
    session: list[dict[str, Any]] | None
    taken: frozenset[int] | None  # None: no restore


def rewarm_pays(outcomes: Sequence[tuple[int, int]], *, evicted: bool = False) -> tuple[bool, str]:
    """(pays, why) from recent re-warms' (tokens kept warm, tokens spent): the tokens kept
    must exceed the prefill spent; too few outcomes: it pays (nothing proves otherwise yet). A
    head known `evicted` never pays: re-prefilled, it saves the next call at most its cost."""
    if evicted:
        return False, "evicted: a re-prefill would spend what the loop's next call saves"
    recent = list(outcomes)[-WINDOW:]
    if len(recent) < MIN_OUTCOMES:
        return True, f"{len(recent)} re-warms measured"
    kept, spent = sum(k for k, _ in recent), sum(s for _, s in recent)
    kept_n = sum(1 for k, _ in recent if k)
    why = (
        f"{kept_n} of the last {len(recent)} re-warms kept; {kept:,} tokens kept warm "
        f"{'>' if kept > spent else '<='} {spent:,} tokens of prefill spent"
    )
    return kept > spent, why


@dataclass(slots=True, kw_only=True)
class KeepState:
    """The kept heads (`kept`: by sha, and sha/copy for the copies after one), the budget, the
    cost rule, the worker's streaks and the run's `summary`. `counter`: what the server counts
    by (None: time); `slots`: llama.cpp's; `restores`: snapshots may be restored."""

    kept: dict[str, Kept]
    budget: Budget
    counter: CounterKind | None
    slots: int | None = None
    poll_s: float = 0.5
    restores: bool = False
    summary: KeepAliveSummary = field(default_factory=KeepAliveSummary)
    total: float = 0  # the counter at the last count (a poll, a re-warm's); 0: time
    landed: float | None = None  # what the last poll counted since the one before
    counted: bool = False  # a poll answered: the next one counts what landed in between
    touched: set[str] = field(default_factory=set)  # heads the loop used since the last poll
    told: bool = False  # the loop tells its calls: the others are foreign
    errors: int = 0  # worker errors in a row
    misses: int = 0  # polls too busy to answer in a row
    backoff_until: float = 0.0  # the worker's back-off: no poll before (monotonic)
    outcomes: list[tuple[int, int]] = field(default_factory=list)  # the cost rule's (kept, spent)
    level: int = 0  # cost back-offs in a row (0: none; else the next re-warm is a probe)
    gate_until: float = 0.0  # no re-warm before (the cost back-off)

    def since(self, kept: Kept, now: float) -> float | None:
        """The foreign activity since `kept` was last used; None: never used nor warmed."""
        if self.counter is None:
            return None if kept.last_used is None else now - kept.last_used
        return None if kept.baseline is None else self.total - kept.baseline

    def status(self, kept: Kept, now: float) -> Status:
        """Where `kept` stands now (the module docstring names each state)."""
        since = self.since(kept, now)
        if kept.given_up is not None or now < kept.retry_at:
            return "given up" if kept.given_up is not None else "backing off"
        if kept.left is not None:
            return "left"
        if kept.lost or since is None:
            return "lost" if kept.lost else "fresh"
        if kept.evicted:
            return "evicted"
        return "due" if self.budget.due(since) else "warm"

    def touch(self, sha256: str, now: float) -> None:
        """The loop just used the head `sha256` (every copy): its baseline is taken at the next
        poll (`due`); by time, its survival counts from `now`."""
        for kept in self.kept.values():
            if kept.head.sha256 == sha256:
                self.touched.add(sha256)
                self.told = True
                kept.last_used = now

    def track(self, body: object, now: float) -> str | None:
        """The loop sent `body`: the first kept head (frames first) it is a session of takes it
        (`session_of`) and is touched; its sha256, or None: none."""
        for kept in sorted(self.kept.values(), key=lambda k: k.head.kind != "frame"):
            if (history := session_of(kept.head, body)) is not None:
                kept.session = history or None
                self.touch(kept.head.sha256, now)
                return kept.head.sha256
        return None

    def polled(self, now: float, got: tuple[float, bool] | PollMiss) -> bool:
        """A poll: the counter's (total, restarted: nothing is cached now, every head lost),
        which ends both worker streaks; or why it gave nothing to count: `busy` (a long prefill
        holds the queue: wait longer each time, so polls cannot pile up), a worker `error`, an
        `empty` answer. Returns whether it counted (else nothing is due this round)."""
        self.summary.polls += 1
        if isinstance(got, str):
            self.summary.skipped_polls += 1
            if got == "busy":
                self.misses += 1
                self._wait(now, self.misses)
            elif got == "error":
                self.worker_error(now, backoff=True)
            return False
        (total, restarted), self.errors, self.misses = got, 0, 0
        self.landed = total - self.total if self.counted else None
        self.total, self.counted = total, True
        for kept in self.kept.values() if restarted else ():
            kept.baseline, kept.slot, kept.lost, kept.left = None, kept.pin, True, None
        return True

    def worker_error(self, now: float, *, backoff: bool) -> None:
        """The worker failed (busy, unreachable, timed out): counted; `backoff`: no poll for a
        while; `MAX_ERRORS` in a row stop the keeper."""
        self.summary.errors += 1
        self.errors += 1
        if backoff:
            self._wait(now, self.errors)
        if self.errors >= MAX_ERRORS and self.summary.stopped_because is None:
            self.summary.stopped_because = f"{self.errors} worker errors in a row"
            self.summary.stopped_by_worker = True

    def refused(self, kept: Kept, exc: Exception, now: float) -> str | None:
        """The worker refused a re-warm of `kept`: not retried for `poll_s * 2**(refusals in a
        row)` (a session just dropped: its fresh tail at the next poll); after `MAX_FAILURES`
        its session is dropped or, with none, the head given up: said (the note), else None."""
        self.summary.errors += 1
        kept.failures += 1
        note = None
        if kept.failures >= MAX_FAILURES:
            what = f"{kept.head.kind} {kept.head.sha256[:12]}"
            why = f"{kept.failures} re-warms in a row failed (last: {exc})"
            kept.failures = 0  # the fresh tail starts its own streak
            if kept.session is not None:
                kept.session = None
                note = (
                    f"{what}: {why}; its session dropped, re-warmed with a fresh tail from now on"
                )
            else:
                kept.given_up = why
                note = f"{what}: {why}; no longer kept"
        kept.retry_at = now + min(MAX_WAIT_S, self.poll_s * 2**kept.failures)
        if note is None:
            return None
        self.summary.dropped.append(note)
        if all(k.given_up is not None for k in self.kept.values()):
            self.summary.stopped_because = "every kept head given up (its re-warms kept failing)"
            self.summary.stopped_by_worker = True
        return note

    def _wait(self, now: float, n: int) -> None:
        self.backoff_until = now + min(MAX_WAIT_S, self.poll_s * 2**n)

    def due(
        self, now: float, *, busy: Collection[int] = (), landed: Collection[int] = ()
    ) -> list[Kept]:
        """The heads to re-warm now, after a poll that saw the `busy` slots serve a prompt and
        the `landed` ones end one (llama.cpp): the loop's uses first (their baselines taken),
        then each by its state; none while a prompt runs (a re-warm would race it) or past
        the cost rule's allowance."""
        touched, self.touched = self.touched, set()
        for kept in self.kept.values():
            sha = kept.head.sha256
            if sha in touched and kept.slot in busy:  # the loop's call still ends there: take
                self.touched.add(sha)  # its baseline at a later poll, once the slot counted it
            elif sha in touched and self.counter is not None:
                kept.baseline, kept.evicted, kept.left = self.total, False, None
                self._discount(kept, float(self.budget.per_request))
                if len(landed) == 1 and kept.pin is None:  # where the loop's call ended
                    kept.slot = next(iter(landed))
        gone = max(self.slots or 0, self.budget.limit + 1)
        due = []
        for kept in self.kept.values():
            if kept.left is not None and self.total - kept.left >= gone:  # as long again:
                kept.left, kept.evicted = None, False  # re-warm it (now due, not gone)
                kept.baseline = self.total - self.budget.limit
            if kept.left is not None or (kept.slot is not None and kept.slot in busy):
                continue  # left to the loop; or its slot serves a prompt (likely the loop's):
            since = self.since(kept, now)  # a re-warm now would go cold in another slot
            taken = self.told and kept.slot in landed and kept.head.sha256 not in touched
            if self.slots and self.budget.unit == "prompts" and (taken or (since or 0) >= gone):
                kept.evicted = True
            if since is None or self.budget.due(since):
                due.append(kept)
        due = [] if busy else [k for k in due if k.given_up is None and now >= k.retry_at]
        return due[: self._allow(now)] if due else []

    def plan(self, kept: Kept, now: float) -> Plan:
        """How to re-warm the due `kept`: a lost or evicted one is restored first (`restores`)
        into a slot no other kept head is known to hold."""
        since, taken = self.since(kept, now), None
        if (kept.lost or kept.evicted) and self.restores:
            held = [k for k in self.kept.values() if k is not kept and not (k.lost or k.evicted)]
            held += [kept] if kept.evicted and not kept.lost else []  # it may be the loop's
            taken = frozenset(k.slot for k in held if k.slot is not None)
        first = since is None or kept.lost or kept.last_used is None  # cold by nature
        return Plan(since, first, kept.session, taken)

    def leave(self, kept: Kept, snap: SnapshotRewarm | None) -> bool:
        """After the restore attempt `snap` (None: none made): True, an evicted head not
        restored is left to the loop (send nothing), never re-prefilled."""
        if not kept.evicted or (snap is not None and snap.check is not None):
            return False
        if rewarm_pays([], evicted=True)[0]:
            return False
        kept.left = self.total
        self.summary.left_to_loop += 1  # re-prefilled, it would save what it costs
        self.summary.restore_misses += snap is not None
        self.errors = kept.failures = 0
        return True

    def rewarmed(
        self,
        kept: Kept,
        plan: Plan,
        record: CallRecord,
        verdict: Verdict,
        now: float,
        *,
        snap: SnapshotRewarm | None = None,
        after: float | None = None,
        landed: Collection[int] = (),
    ) -> Rewarm:
        """`kept` was re-warmed (or restored: `snap`): its `record` and the judge's `verdict`,
        the counter `after` it (None: not read) and the slots it saw `landed`. Warm from now;
        the budget learns (a miss tightens it), the cost rule weighs it (not a first warm), and
        it is counted. Returns its record."""
        kept.lost, kept.evicted, kept.last_used = False, False, now
        if self.counter is not None:
            self._rebase(kept, record, after, landed)
        b = self.budget
        survives, unit = b.limit, b.unit  # before a miss tightens it
        change = b.learn(record.before, record.after, record.interleaved, verdict, plan.since)
        if judge_burst(verdict, first=plan.first, landed=self.landed, survives=survives, unit=unit):
            self.summary.burst(self.landed or 0.0, survives, unit)
        if change is not None:
            self.summary.budget_changes.append(change)
        ev = record.evidence
        if not plan.first and verdict != "unverified" and ev.prompt_tokens is not None:
            cached = ev.cached_tokens or 0
            warm = cached if verdict == "resumed" else 0
            self._weigh(warm, ev.prompt_tokens - cached, now, tightened=change is not None)
        head, report = kept.head, None if snap is None else snap.to_dict()
        frame = head.sha256 if head.kind == "frame" else None
        rewarm = Rewarm(
            head.system.sha256, plan.since, verdict, record, b.limit, unit, frame, report
        )
        self.summary.count(rewarm, snap, session=plan.session is not None, first=plan.first)
        self.errors = kept.failures = 0
        return rewarm

    def _rebase(
        self, kept: Kept, record: CallRecord, after: float | None, landed: Collection[int]
    ) -> None:
        """After a re-warm of `kept`: it counts from now, and what our own request added is
        not foreign activity for the other kept heads (the budget allowed for their entries;
        counting it too would make the keeper re-warm its heads in turn forever)."""
        before = self.total
        if self.counter == "stores":
            own = float(self.budget.per_request)
            b, a = record.before, record.after
            if after is not None:
                if (
                    b is not None
                    and b.stores is not None
                    and a is not None
                    and a.stores is not None
                ):
                    own = own if record.interleaved else float(a.stores - b.stores)
                self.total = kept.baseline = after
            else:
                # No closing snapshot: count from what was there plus our own stores, so
                # the next poll sees only what others stored since.
                kept.baseline = before + own
        else:
            # Our own prompt is the one change we expect; any other prompt that landed
            # meanwhile counts against the head (which slot is least recently used is then
            # unknown: assume the worse). Not read: the next poll sees it, since 0.
            own, kept.baseline = 1.0, before + 1
            if after is not None:
                self.total, kept.baseline = after, min(after, before + 1)
                kept.slot = next(iter(landed)) if len(landed) == 1 else kept.pin
        self._discount(kept, own)

    def _discount(self, kept: Kept, own: float) -> None:
        """A request of ours on `kept` (a re-warm, a loop call) is not foreign to the others."""
        for other in self.kept.values():
            if other is not kept and other.baseline is not None:
                other.baseline += own

    def _allow(self, now: float) -> int:
        """How many due heads may be re-warmed now (0: backing off; 1: a probe)."""
        if now < self.gate_until:
            return 0
        if self.level:
            return 1
        pays, why = rewarm_pays(self.outcomes)
        if pays:
            return len(self.kept)
        self._back_off(now, why)
        return 0

    def _weigh(self, kept: int, spent: int, now: float, *, tightened: bool) -> None:
        """One re-warm (not a first warm): the tokens it kept warm (0: not kept), and spent.
        `tightened`: its miss tightened the budget; start afresh (older ones speak of the old)."""
        self.outcomes = [] if tightened else [*self.outcomes[-WINDOW + 1 :], (kept, spent)]
        if not self.level:
            return
        if kept:
            self.level, self.outcomes = 0, self.outcomes[-1:]
        else:
            self._back_off(now, f"the probe after backing off was not kept ({spent:,} spent)")

    def _back_off(self, now: float, why: str) -> None:
        self.summary.backoffs, self.summary.backoff_reason = self.summary.backoffs + 1, why
        self.gate_until = now + min(MAX_BACKOFF_S, BACKOFF_S * 2**self.level)
        self.level += 1

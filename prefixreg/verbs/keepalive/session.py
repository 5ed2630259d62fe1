"""A loop's session for the keeper: the latest full request the loop sent on a kept head (head
and history), told in process (`KeepAlive.track(body)`) or across processes (`--session FILE`,
one JSON request body per line, appended by the loop after each call); the cost rule that keeps
the keeper from making the loop slower; and what the keeper knows of each kept head (`Kept`:
its counts, slot and session, moved by `rebase` and `discount`).

Invariants:
- A body is a session of a head only when the head's drift check finds nothing (its system
  message, a frame's tools and settings, byte for byte) and, for a bare prefix, it sends no
  tools or template settings (`beyond_prefix`: the keeper could not re-send them, so it
  would keep warm a prompt the loop never sends); its history is copied.
- A session is re-touched whole (the latest prompt again, one output token): the judge
  reads it against the session's span (its bytes are the head's and the history's), so a
  re-touch that finds only the head cached is partial, never resumed.
- A session file is read through `read_user_file` (a regular file, never a FIFO, capped),
  on from the last complete line (a long loop's file is never read whole again), each body
  through `core.jsonio`; only complete lines count (a half-written last line waits), and a
  last line that is not a request body reads as None, never a crash.
- A session file is used only if no other local user could have written it: owned by this
  user (root too) and neither group- nor world-writable (`userfiles.refuse_shared`), checked at
  every read (a later chmod counts), else UsageError; its lines go out with the user's key.
- A head whose re-warms fail `MAX_FAILURES` times in a row (`failed`) loses its session (it is
  re-warmed with a fresh tail from then on, until the loop tells a new one), then, failing
  on, is given up; a 503 (busy) is the worker's state, not the head's, and never counts.
- `rewarm_pays` is pure: re-warms go on while the tokens they keep warm exceed the prefill
  they spend, over a few recent re-warms; a head known evicted is never re-prefilled.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from prefixreg.core.errors import PrefixregError, UsageError, WorkerError
from prefixreg.core.frame import Head, beyond_prefix, not_a_prefix_call
from prefixreg.core.jsonio import loads
from prefixreg.core.judge import Verdict, judge
from prefixreg.core.prefix import check_history, fresh_tail, text_bytes
from prefixreg.core.records import ServerBuild
from prefixreg.registry.userfiles import (
    MAX_INPUT_BYTES,
    open_user_file,
    read_open,
    refuse_shared,
)
from prefixreg.server.activity import Counter, StoresCounter
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.calls import CallRecord, judge_check, measured_call

# The re-warms the cost rule looks back on, and how many it needs before it may say no.
WINDOW: Final = 6
MIN_OUTCOMES: Final = 3
# The first back-off, in seconds; each probe that is not kept doubles it, up to the cap.
BACKOFF_S: Final = 10.0
MAX_BACKOFF_S: Final = 600.0
# Failed re-warms of one head in a row before its session is dropped (then the head given up).
MAX_FAILURES: Final = 5


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


def failed(kept: Kept, exc: WorkerError, backoff_s: Callable[[int], float]) -> str | None:
    """The worker refused a re-warm of `kept`: not retried for `backoff_s(refusals in a row)`
    (a session just dropped: its fresh tail at the next poll); after `MAX_FAILURES` in a row
    its session is dropped or, with none, the head given up. Returns that, said for a
    person, else None."""
    note = None
    kept.failures += 1
    if kept.failures >= MAX_FAILURES:
        what = f"{kept.head.kind} {kept.head.sha256[:12]}"
        why = f"{kept.failures} re-warms in a row failed (last: {exc})"
        kept.failures = 0  # the fresh tail starts its own streak
        if kept.session is not None:
            kept.session = None
            note = f"{what}: {why}; its session dropped, re-warmed with a fresh tail from now on"
        else:
            kept.given_up = why
            note = f"{what}: {why}; no longer kept"
    kept.retry_at = time.monotonic() + backoff_s(kept.failures)
    return note


def _sent(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A request as the worker reads it: openai kwargs' `extra_body` merged in."""
    extra = body.get("extra_body")
    return {**body, **extra} if isinstance(extra, Mapping) else body


def session_of(head: Head, body: object) -> list[dict[str, Any]] | None:
    """The history of `body` (a request as sent: `Frame.body`, or openai kwargs with
    `extra_body`) when it sends `head` unchanged and nothing the head cannot re-send
    (`beyond_prefix`); None when it is not a request of `head`."""
    if not isinstance(body, Mapping) or not isinstance(body.get("messages"), list):
        return None
    sent = _sent(body)
    if head.drift(sent) or beyond_prefix(head, sent):
        return None
    try:
        return check_history(sent["messages"][1:])
    except UsageError:  # a message without a role: no request the keeper could re-send
        return None


def why_not_kept(heads: Iterable[Head], body: Mapping[str, Any]) -> str:
    """Why `body` is a session of none of `heads`, said for a person: the head it sends
    unchanged but with tools or settings a bare prefix cannot re-send, else drift."""
    for head in heads:
        sent = _sent(body)
        if (extra := beyond_prefix(head, sent)) and not head.drift(sent):
            return not_a_prefix_call(
                head, extra, "the keeper would warm a prompt the loop never sends"
            )
    return "the body sends none of the kept heads unchanged"


def rewarm_call(
    worker: Worker, build: ServerBuild, kept: Kept, counter: Counter | None, *, alignment: int
) -> tuple[CallRecord, Verdict]:
    """One re-warm of `kept` (in its pinned slot) and the judge's verdict: the session
    re-touched whole (judged against its bytes, the head's and the history's text), else the
    head with a fresh tail (against its span measured on this build)."""
    head, session, tail = kept.head, kept.session, fresh_tail()
    stores = isinstance(counter, StoresCounter)
    before = counter.last if isinstance(counter, StoresCounter) else None
    pin: dict[str, Any] = {} if kept.pin is None else {"id_slot": kept.pin}
    record = measured_call(
        worker,
        head,
        build=build,
        phase="keepalive",
        tail=tail,
        with_cache=stores,
        before=before,
        history=session,
        **pin,
    )
    if session is None:
        j = judge_check(record.evidence, head, tail=tail, alignment=alignment, measured=kept.span)
    else:
        held = head.head_bytes + text_bytes(session)  # the head and the history: all re-touched
        rest = len(tail.encode("utf-8"))
        j = judge(record.evidence, head_bytes=held, rest_bytes=rest, alignment=alignment)
    return record, j.verdict


def rewarm_pays(outcomes: Sequence[tuple[int, int]], *, evicted: bool = False) -> tuple[bool, str]:
    """(pays, why) from recent re-warms' (tokens kept warm, tokens spent): the tokens kept
    must exceed the prefill spent. Too few outcomes: it pays (nothing proves otherwise yet). A
    head known `evicted` never pays: re-prefilled, it saves the loop's next call at most what
    it spends."""
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


class CostGate:
    """The keeper's back-off: re-warms go on while `rewarm_pays`; when it says no, none is
    sent for `BACKOFF_S` (doubling), then one probe: kept, and the rule starts afresh from
    it; not kept, a longer back-off. Every back-off is counted and said (`why`)."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[int, int]] = []
        self.backoffs = 0  # back-offs so far (the summary's)
        self.why: str | None = None  # the latest back-off's reason
        self.until = 0.0
        self.level = 0  # back-offs in a row (0: not backing off; else the next is a probe)

    def allow(self, now: float) -> int:
        """How many due heads may be re-warmed now (0: backing off; 1: a probe)."""
        if now < self.until:
            return 0
        if self.level:
            return 1
        pays, why = rewarm_pays(self.outcomes)
        if pays:
            return 1 << 30
        self._back_off(now, why)
        return 0

    def saw(self, kept: int, spent: int, now: float, *, tightened: bool = False) -> None:
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
        self.backoffs, self.why = self.backoffs + 1, why
        self.until = now + min(MAX_BACKOFF_S, BACKOFF_S * 2**self.level)
        self.level += 1


class SessionFile:
    """The JSON-lines file a loop appends its request bodies to (one per call)."""

    def __init__(self, path: Path | str) -> None:
        """Raises UsageError: `path` exists and is not a regular file (a FIFO, a directory),
        or another local user could have written it (`refuse_shared`)."""
        self.path = Path(path)
        if (opened := self._open()) is not None:  # None: the loop has not called yet
            os.close(opened[0])
        self._seen: tuple[int, int] | None = None  # (size, mtime) at the last read
        self._offset = 0  # the end of the last complete line read: a long loop's file is
        # read on from there, never whole again (its size bounds no memory, only a line does)

    def _open(self) -> tuple[int, os.stat_result] | None:
        """The file opened and its status from the descriptor (what is checked is what is
        read); None: missing. Raises UsageError: not a regular file, unreadable, or another
        local user could have written it (each line is sent with the user's key)."""
        try:
            fd, st = open_user_file(self.path)
        except FileNotFoundError:
            return None
        except UsageError as exc:
            raise UsageError(f"--session {exc}") from None
        try:
            refuse_shared(st, f"--session {self.path}")
        except UsageError:
            os.close(fd)
            raise
        return fd, st

    def read(self) -> tuple[int, object]:
        """(requests appended since the last read, the latest body or None). A missing file
        is a loop that has not called yet; a truncated one starts over. Raises UsageError: not
        a regular file (a FIFO, a directory), unreadable, too large, or writable by another
        local user."""
        if (opened := self._open()) is None:
            return 0, None
        fd, st = opened
        if self._seen == (st.st_size, st.st_mtime_ns):
            os.close(fd)
            return 0, None
        if st.st_size < self._offset:  # truncated by the loop: start over
            self._offset = 0
        start = max(self._offset, st.st_size - MAX_INPUT_BYTES)  # only the latest line counts:
        data = read_open(fd, self.path, offset=start)  # a keeper started on a long loop's
        if start > self._offset:  # file reads its last 64 MiB, from the first line there
            cut = data.find(b"\n") + 1
            data, start = data[cut:], start + cut
        self._seen = (st.st_size, st.st_mtime_ns)
        end = data.rfind(b"\n") + 1
        self._offset = start + end
        lines = [line for line in data[:end].split(b"\n") if line.strip()]
        if not lines:
            return 0, None
        try:
            return len(lines), loads(lines[-1], path=self.path)
        except PrefixregError:  # not a request body: counted, its body None
            return len(lines), None


def rebase(
    kept: Kept, all_kept: Iterable[Kept], counter: Counter, record: CallRecord, per_request: int
) -> None:
    """After a re-warm of `kept`: it counts from now, and what our own request added is not
    foreign activity for the other kept heads (the budget allowed for their entries;
    counting it too would make the keeper re-warm its heads in turn forever)."""
    before = counter.total
    if isinstance(counter, StoresCounter):
        own = float(per_request)
        after, b = record.after, record.before
        if after is not None and after.stores is not None:
            if b is not None and b.stores is not None and not record.interleaved:
                own = float(after.stores - b.stores)
            counter.saw(after)
            kept.baseline = counter.total
        else:
            # No closing snapshot: count from what was there plus our own stores, so
            # the next poll sees only what others stored since.
            kept.baseline = before + own
    else:
        # Our own prompt is the one change we expect; any other prompt that landed
        # meanwhile counts against the head (which slot is least recently used is then
        # unknown: assume the worse).
        own, kept.baseline, got = 1.0, before + 1, None
        try:
            got = counter.read()
        except WorkerError:
            pass  # the next poll sees our prompt and lands on since 0
        if got is not None:
            kept.baseline = min(got[0], before + 1)
            kept.slot = next(iter(counter.changed)) if len(counter.changed) == 1 else kept.pin
    discount(kept, all_kept, own)


def discount(kept: Kept, all_kept: Iterable[Kept], own: float) -> None:
    """A request of ours on `kept` (a re-warm, a loop call) is not foreign to the others."""
    for other in all_kept:
        if other is not kept and other.baseline is not None:
            other.baseline += own

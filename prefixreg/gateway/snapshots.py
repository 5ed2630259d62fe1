"""Kept whole across foreign prompts: on a llama.cpp worker that has slot actions
(`--slot-save-path`), `--keep-warm` pins each live chat session to a slot of its own, saves
that slot's KV state after each of the session's calls, and restores it as soon as a prompt
the gateway did not send has taken the slot, in the loop's tool time. A tenant talking to the
worker directly then costs the loop a restore of milliseconds, not a cold prefill.

Invariants:
- A snapshot is kept only when it is provably the session's: the slot was idle with the same
  task before and after the save, no call of the session was in flight, and the saved count
  lies between the call's prompt tokens and its prompt plus completion tokens (llama.cpp keeps
  the prompt and the reply it generated). Anything else drops the slot's snapshot.
- A restore is sent only to an idle slot whose task changed since the snapshot (a foreign
  prompt ran there) while no call of the session is in flight, and it counts only when the
  server restored exactly the saved count. Whether the next call resumed is the judge's, from
  that call's own numbers (`x-prefixreg-verdict`): a restore never proves itself.
- Bounded: one file a slot a gateway process in the server's `--slot-save-path`
  (`prefixreg-gateway-<tag>-slot<N>.bin`, the tag from the host and the process id, so two
  replicas never overwrite each other's); at most one session a slot; a slot is freed when
  its session expires.
- Never the loop's failure: every worker call runs off the event loop (the start's thread,
  then this module's two: saves at once, polls); a worker without slot actions (501) leaves
  snapshot mode for good (the re-warm keeper takes it), any other failure is logged and
  counted, and calls go on; a worker unreachable at start is read again every `RETRY_S`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final

from prefixreg.core.errors import PrefixregError, UsageError
from prefixreg.gateway.metrics import Metrics
from prefixreg.server.slots import list_slots, slot_action
from prefixreg.server.transport import display_url
from prefixreg.server.worker import Worker

log = logging.getLogger("prefixreg.gateway")
POLL_S: Final = 0.1  # how soon a foreign prompt's slot is seen (one GET /slots a worker)
RETRY_S: Final = 30.0  # a worker that could not be read at start is read again this often


@dataclass(frozen=True)
class _Saved:
    worker: str
    slot: int
    session: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Snapshot:
    session: str
    n_tokens: int
    task: int | None  # the slot's task when saved or restored; None: unknown (restore)
    name: str  # the file it is in
    file: int  # which of the slot's two files


@dataclass
class _Worker:
    url: str
    client: Worker  # the saves' thread's
    poller: Worker  # the polls' thread's (one client a thread)
    slots: tuple[int, ...] = ()
    owner: dict[int, str] = field(default_factory=dict)  # slot -> session, oldest first
    returning: set[str] = field(default_factory=set)  # owners that came back (kept first)
    kept: dict[int, _Snapshot] = field(default_factory=dict)  # slot -> its saved state
    inflight: dict[int, int] = field(default_factory=dict)  # slot -> calls on their way
    io: threading.Lock = field(default_factory=threading.Lock)  # one slot action at a time


class Snapshots:
    """Each worker's pinned sessions and their saved slots (see the module docstring)."""

    def __init__(self, workers: tuple[str, ...], metrics: Metrics, *, api_key: str | None) -> None:
        self.metrics = metrics
        self.api_key = api_key
        self.tag = hashlib.sha256(f"{socket.gethostname()}|{os.getpid()}".encode()).hexdigest()[:8]
        self._urls = workers
        self._workers: dict[str, _Worker] = {}  # only the workers in snapshot mode
        self._left: list[_Worker] = []  # workers that left it (no slot actions)
        self._unread: list[str] = []  # workers not read yet (unreachable at start)
        self._lock = threading.Lock()  # guards owner/inflight/kept across the two threads
        self._queue: queue.Queue[_Saved] = queue.Queue(64)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- lifecycle (the gateway's start and stop) ------------------------------------------
    def start(self) -> None:
        """Read the workers (before the gateway serves: its first call is kept too), then
        start the two threads; a worker that cannot be read is tried again every `RETRY_S`
        on the polls' thread."""
        self._unread = [u for u in self._urls if not self._discover(u)]
        for run in (self._run_saves, self._run_polls):
            thread = threading.Thread(target=run, name="prefixreg-snapshots", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=30)
        for w in [*self._workers.values(), *self._left]:
            w.client.close()
            w.poller.close()

    def covers(self, worker: str) -> bool:
        """Whether `worker`'s sessions are kept by snapshots (else the re-warm keeper's)."""
        return worker in self._workers

    # -- the event loop's side: pin, finish, release (in memory, under the lock) -----------
    def pin(
        self, worker: str, session: str, body: dict[str, Any], *, returning: bool
    ) -> int | None:
        """The slot this session's call is pinned to (`body["id_slot"]` set), or None. A new
        session takes a free slot, else the oldest one a session that never came back holds
        (a one-off prompt's); a session that came back keeps its slot while it lives."""
        w = self._workers.get(worker)
        if w is None or "id_slot" in body:
            return None
        with self._lock:
            slot = next((s for s, sid in w.owner.items() if sid == session), None)
            if slot is None:
                free = [s for s in w.slots if s not in w.owner]
                oneoff = [s for s, sid in w.owner.items() if sid not in w.returning]
                if not free and not oneoff:
                    return None  # every slot holds a live session that came back: shared
                slot = free[0] if free else oneoff[0]
                w.kept.pop(slot, None)
                w.owner.pop(slot, None)
                w.owner[slot] = session
            if returning:
                w.returning.add(session)
            w.inflight[slot] = w.inflight.get(slot, 0) + 1
        body["id_slot"] = slot
        return slot

    def finished(
        self, worker: str, slot: int, session: str, prompt: int | None, completion: int | None
    ) -> None:
        """A pinned call is over; with its counts (a reply the server judged), save its slot."""
        w = self._workers.get(worker)
        if w is None:
            return
        with self._lock:
            w.inflight[slot] = max(0, w.inflight.get(slot, 0) - 1)
        if prompt is None or w.owner.get(slot) != session:
            return
        try:
            self._queue.put_nowait(_Saved(worker, slot, session, prompt, completion or 0))
        except queue.Full:
            self.metrics.add("failures_total", where="snapshots")

    def release(self, session: str) -> None:
        """An expired session: its slot is free, its snapshot no longer restored."""
        with self._lock:
            for w in self._workers.values():
                w.returning.discard(session)
                for slot in [s for s, sid in w.owner.items() if sid == session]:
                    del w.owner[slot]
                    w.kept.pop(slot, None)

    # -- the two threads: saves at once, a poll for foreign prompts --------------------------
    def _run_saves(self) -> None:
        while not self._stopping.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            w = self._workers.get(item.worker)
            if w is not None:
                self._guarded(w, self._save, item)

    def _discover(self, url: str) -> bool:
        """Whether `url` was read (a llama.cpp worker with slots is then in snapshot mode)."""
        try:
            with Worker(url, api_key=self.api_key, timeout=5.0) as probe:
                if probe.server_build().profile != "llamacpp":
                    return True
                ids = tuple(sorted(s.id for s in list_slots(probe)))
        except (PrefixregError, OSError) as exc:
            self._failed("discover", url, exc)
            return False
        if ids:
            clients = [Worker(url, api_key=self.api_key, timeout=10.0) for _ in range(2)]
            with self._lock:
                self._workers[url] = _Worker(url, clients[0], clients[1], ids)
        return True

    def _run_polls(self) -> None:
        last_try = time.monotonic()
        while True:
            if self._unread and time.monotonic() - last_try >= RETRY_S:
                self._unread = [u for u in self._unread if not self._discover(u)]
                last_try = time.monotonic()
            if self._stopping.wait(POLL_S):
                return
            for w in list(self._workers.values()):
                if w.kept:
                    self._guarded(w, self._restore_taken, None)

    def _guarded(self, w: _Worker, step: Any, arg: Any) -> None:
        try:
            step(w) if arg is None else step(w, arg)
        except UsageError as exc:  # 501: no --slot-save-path; the re-warm keeper's from now on
            self._leave(w, exc)
        except Exception as exc:  # noqa: BLE001 -- never the loop's failure
            self._failed("snapshot", w.url, exc)

    def _busy(self, w: _Worker, slot: int) -> bool:
        with self._lock:
            return w.inflight.get(slot, 0) > 0

    def _save(self, w: _Worker, saved: _Saved) -> None:
        """Save at once (the server runs tasks in order: before a prompt sent after the reply),
        into the file the last good snapshot is not in, so a refused save loses nothing."""
        with w.io:
            old = w.kept.get(saved.slot)
            name = self._filename(saved.slot, 1 - old.file if old is not None else 0)
            reply = slot_action(w.client, saved.slot, "save", name)
            n = reply.n_tokens
            ok = (
                n is not None
                and saved.prompt_tokens <= n <= saved.prompt_tokens + saved.completion_tokens
            )
            now = (
                next((s for s in list_slots(w.client) if s.id == saved.slot), None) if ok else None
            )
        with self._lock:
            if ok and n is not None and w.owner.get(saved.slot) == saved.session:
                # A slot already busy again may hold anyone's prompt: restored once idle.
                task = now.id_task if now is not None and now.idle else None
                w.kept[saved.slot] = _Snapshot(
                    saved.session, n, task, name, 1 - old.file if old else 0
                )
        self._count("save", w.url, "ok" if ok else "refused")

    def _restore_taken(self, w: _Worker) -> None:
        with self._lock:
            kept = dict(w.kept)
        slots = {s.id: s for s in list_slots(w.poller)}
        for slot, snap in kept.items():
            now = slots.get(slot)
            if now is None or not now.idle or (snap.task is not None and now.id_task == snap.task):
                continue  # untouched, or busy: looked at again on the next poll
            with w.io:
                if self._busy(w, slot) or w.kept.get(slot) is not snap:
                    continue  # the session's own call came, or a newer save
                reply = slot_action(w.poller, slot, "restore", snap.name)
            ok = reply.n_tokens == snap.n_tokens
            with self._lock:
                if ok and w.kept.get(slot) is snap:
                    snap.task = now.id_task
                elif not ok:
                    w.kept.pop(slot, None)
            self._count("restore", w.url, "ok" if ok else "failed")
            if ok:
                self.metrics.add("restored_tokens_total", snap.n_tokens, worker=display_url(w.url))

    def _filename(self, slot: int, file: int) -> str:
        return f"prefixreg-gateway-{self.tag}-slot{slot}-{file}.bin"

    def _count(self, action: str, url: str, outcome: str) -> None:
        self.metrics.add("snapshots_total", action=action, worker=display_url(url), outcome=outcome)

    def _leave(self, w: _Worker, exc: BaseException) -> None:
        with self._lock:
            if self._workers.pop(w.url, None) is not None:
                self._left.append(w)  # its clients are closed at stop: a thread may hold one
        self._failed("snapshots", w.url, exc)
        log.warning(
            "%s has no slot actions: its sessions are re-warmed instead", display_url(w.url)
        )

    def _failed(self, where: str, url: str, exc: BaseException) -> None:
        self.metrics.add("failures_total", where="snapshots")
        log.warning(
            "%s on %s failed (%s); calls go on", where, display_url(url), type(exc).__name__
        )

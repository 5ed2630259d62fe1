"""Kept warm between turns: each live session's latest chat request is kept resumable by the
keepalive machinery (`verbs.keepalive.KeepAlive`: its cost rule, back-off and budget), one
keeper per worker over the heads of its live sessions, run on threads the gateway starts and
stops. Its re-warms go straight to the worker, so they never count as the loop's calls; they
are counted apart (`rewarms_total`).

Invariants:
- Nothing here runs on the event loop but `saw` (a queue put): building a keeper reads the
  worker (`server_build`, `/slots`), re-warms are HTTP calls; both on the manager's thread.
- A worker's keeper keeps at most `MAX_HEADS` heads (llama.cpp: its slots), the most
  recently used; the set changes only when a new head comes or one goes idle, and a change
  rebuilds that worker's keeper (the old one stopped first: one request at a time).
- Only chat-completions sessions are kept (the keeper re-sends chat bodies).
- Never the loop's failure: a keeper that cannot be built or stops is logged and counted
  (`failures_total{where="keeper"}`); calls go on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Final

from prefixreg.core.errors import PrefixregError
from prefixreg.core.frame import Frame
from prefixreg.core.frame import Head as KeptHead
from prefixreg.core.jsonio import dumps_canonical, dumps_ordered, loads_object
from prefixreg.core.prefix import Prefix
from prefixreg.gateway.head import Head
from prefixreg.gateway.metrics import Metrics
from prefixreg.server.transport import display_url
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.rewarm import Rewarm
from prefixreg.verbs.keepalive.run import KeepAlive

log = logging.getLogger("prefixreg.gateway")
MAX_HEADS: Final = 4


def kept_head(head: Head, tools: Any) -> KeptHead:
    """The head as the keeper holds it: a `Prefix`, or a `Frame` over the exact bytes the
    gateway hashed (the system text, the tools as `dumps_ordered` writes them)."""
    system = Prefix(head.system_sha256, head.system)
    if head.is_prefix:
        return system
    tools_data = None if head.tools_sha256 is None else dumps_ordered(tools).encode("utf-8")
    settings = dumps_canonical(loads_object(head.settings_json))
    # A head extended by a frame's leading messages is kept as its parts' frame: a session's
    # re-warm re-sends its whole latest body, leading messages and all.
    return Frame(head.base_sha256 or head.sha256, system, head.tools_sha256, tools_data, settings)


@dataclass(frozen=True)
class _Seen:
    worker: str
    head: Head
    tools: Any
    body: dict[str, Any]


_IDLE: Final = _Seen("", Head("", "", None, "{}", b"", 0, False), None, {})


@dataclass
class _Worker:
    url: str
    heads: OrderedDict[str, tuple[KeptHead, float]] = field(default_factory=OrderedDict)
    keeper: KeepAlive | None = None


class Keeper:
    """The keepers of every worker, behind one queue and one manager thread."""

    def __init__(self, metrics: Metrics, *, idle_s: float, api_key: str | None) -> None:
        self.metrics = metrics
        self.idle_s = idle_s
        self.api_key = api_key
        self._queue: queue.Queue[_Seen | None] = queue.Queue(
            32
        )  # a full queue drops the call (counted)
        self._workers: dict[str, _Worker] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefixreg-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
        for w in self._workers.values():
            self._stop(w)

    def saw(self, worker: str, head: Head, tools: Any, body: dict[str, Any]) -> None:
        """A chat call on `head` returned from `worker` with `body` sent: keep it warm."""
        try:
            self._queue.put_nowait(_Seen(worker, head, tools, body))
        except queue.Full:
            self.metrics.add("failures_total", where="keeper")

    # -- the manager's thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                item = _IDLE  # nothing new: only expire
            if item is None:
                return
            try:
                if item is not _IDLE:
                    self._take(item.worker, item.head, item.tools, item.body)
                self._expire()
            except Exception as exc:  # noqa: BLE001 -- never the loop's failure
                self.metrics.add("failures_total", where="keeper")
                log.warning("keeper failed (%s); calls go on", type(exc).__name__)

    def _take(self, url: str, head: Head, tools: Any, body: dict[str, Any]) -> None:
        w = self._workers.setdefault(url, _Worker(url))
        known = head.sha256 in w.heads
        w.heads[head.sha256] = (
            w.heads[head.sha256][0] if known else kept_head(head, tools),
            time.monotonic(),
        )
        w.heads.move_to_end(head.sha256)
        while len(w.heads) > MAX_HEADS:
            w.heads.popitem(last=False)
            known = False
        if not known or w.keeper is None or not w.keeper.alive:
            self._rebuild(w)
        if w.keeper is not None:
            try:
                w.keeper.track(body)
            except PrefixregError:
                pass  # a body the keeper cannot re-send: the head alone stays kept

    def _expire(self) -> None:
        now = time.monotonic()
        for w in self._workers.values():
            idle = [sha for sha, (_, seen) in w.heads.items() if now - seen > self.idle_s]
            for sha in idle:
                del w.heads[sha]
            if idle:
                self._rebuild(w)

    def _rebuild(self, w: _Worker) -> None:
        self._stop(w)
        if not w.heads:
            return
        heads = [h for h, _ in w.heads.values()]
        label = display_url(w.url)
        try:
            worker = Worker(w.url, api_key=self.api_key, timeout=10.0)
            slots = worker.slots() if worker.server_build().profile == "llamacpp" else None
            if slots:
                heads = heads[-len(slots) :]
            w.keeper = KeepAlive(worker, heads, on_rewarm=lambda r: self._rewarmed(r, label))
            w.keeper.start()
        except (PrefixregError, OSError) as exc:
            w.keeper = None
            self.metrics.add("failures_total", where="keeper")
            log.warning("keeper for %s not started (%s)", label, type(exc).__name__)

    def _rewarmed(self, rewarm: Rewarm, worker: str) -> None:
        head = (rewarm.frame or rewarm.sha256)[:12]
        self.metrics.add("rewarms_total", head=head, worker=worker, outcome=rewarm.verdict)

    @staticmethod
    def _stop(w: _Worker) -> None:
        if w.keeper is not None:
            try:
                w.keeper.stop()
            finally:
                w.keeper.worker.close()
                w.keeper = None

"""Which slot a call is pinned to (`Pins`): a session's own with `--own-slots` (`SlotPlan`, below),
or with `--keep-warm` the one its state is saved from and restored to (`gateway.snapshots`).

Slots of its own: on llama.cpp workers (a request may pick its slot with `id_slot`), each
live session with a head owns a slot, and every other call is pinned to the slots no session
owns, so a burst of foreign prompts cannot evict a loop's history between two of its calls.
Only right when every client of the worker comes through the gateway (`--own-slots`).

Invariants:
- A worker takes part only when `/slots` lists at least two slots (one stays shared); the
  count is read once at start, off the event loop; a worker that cannot be read is left as
  it is (logged, counted), never the loop's failure.
- A session owns a slot from its second call on (a one-off prompt never does), at most
  `slots - 1` sessions per worker; a session's slot is freed when it expires or moves to
  another worker. A session that finds none free shares like the others.
- Shared calls spread over the unowned slots by their head's sha (one head, one slot: its
  prefix stays there); a call that names its own `id_slot` is left alone.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from typing import Any

from prefixreg.core.errors import PrefixregError
from prefixreg.core.records import CallEvidence
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.metrics import Metrics
from prefixreg.gateway.sessions import Session
from prefixreg.gateway.snapshots import Snapshots
from prefixreg.server.slots import list_slots
from prefixreg.server.worker import Worker

log = logging.getLogger("prefixreg.gateway")


class SlotPlan:
    """Which slot each call of each worker goes to (see the module docstring)."""

    def __init__(self, workers: Iterable[str], api_key: str | None) -> None:
        self.workers = tuple(workers)
        self.api_key = api_key
        self.slots: dict[str, list[int]] = {}  # worker -> slot ids, when it takes part
        self.owner: dict[str, dict[int, str]] = {}  # worker -> slot -> session id
        self.failures = 0

    def discover(self) -> None:
        for url in self.workers:
            try:
                with Worker(url, api_key=self.api_key, timeout=5.0) as worker:
                    ids = sorted(s.id for s in list_slots(worker))
            except (PrefixregError, OSError) as exc:
                self.failures += 1
                log.warning("own slots: %s has no slots to read (%s)", url, type(exc).__name__)
                continue
            if len(ids) >= 2:
                self.slots[url], self.owner[url] = ids, {}
            else:
                log.warning("own slots: %s has %d slot(s); it needs two", url, len(ids))

    def release(self, session_id: str) -> None:
        for owners in self.owner.values():
            for slot in [s for s, sid in owners.items() if sid == session_id]:
                del owners[slot]

    def assign(
        self,
        worker: str,
        session_id: str | None,
        head_sha: str | None,
        body: dict[str, Any],
        *,
        returning: bool,
        last_slot: int | None,
    ) -> int | None:
        """The slot this call is pinned to (set as `body["id_slot"]`), or None (unchanged).
        A session claims a slot on its second call (`returning`): the one its last call used
        when no other session owns it (its history is there), else a free one; one-off
        prompts (a tenant's) never own one."""
        ids = self.slots.get(worker)
        if ids is None or "id_slot" in body:
            return None
        owners = self.owner[worker]
        slot = None
        if session_id is not None and head_sha is not None:
            slot = next((s for s, sid in owners.items() if sid == session_id), None)
            if slot is None and returning:
                self.release(session_id)  # it may have moved here from another worker
                free = [s for s in ids if s not in owners]
                if len(free) >= 2:  # one slot always stays shared
                    slot = last_slot if last_slot in free else free[0]
                    owners[slot] = session_id
        if slot is None:
            shared = [s for s in ids if s not in owners]
            key = (head_sha or "").encode("ascii")
            slot = shared[int(hashlib.sha256(key).hexdigest()[:8], 16) % len(shared)]
        body["id_slot"] = slot
        return slot

    def owned(self) -> int:
        return sum(len(o) for o in self.owner.values())


class Pins:
    """The slot plan (`--own-slots`) or the snapshots (`--keep-warm` without it), or neither."""

    def __init__(self, config: GatewayConfig, metrics: Metrics) -> None:
        key = config.upstream_key
        self.plan = SlotPlan(config.workers, key) if config.own_slots else None
        keep = config.keep_warm and not config.own_slots and config.router is None
        self.snapshots = Snapshots(config.workers, metrics, api_key=key) if keep else None

    def start(self) -> None:
        if self.plan is not None:
            self.plan.discover()
        if self.snapshots is not None:
            self.snapshots.start()

    def stop(self) -> None:
        if self.snapshots is not None:
            self.snapshots.stop()

    def release(self, session_id: str) -> None:
        if self.plan is not None:
            self.plan.release(session_id)
        if self.snapshots is not None:
            self.snapshots.release(session_id)

    def pin(
        self,
        worker: str,
        session: Session,
        head_sha: str | None,
        body: dict[str, Any],
        *,
        chat: bool,
    ) -> tuple[int | None, bool]:
        """(the slot set as `body["id_slot"]` or None, whether the snapshots pinned it)."""
        if self.plan is not None:
            last = session.slot if session.worker == worker else None
            owner = session.id if head_sha is not None else None
            session.slot = self.plan.assign(
                worker, owner, head_sha, body, returning=session.calls > 0, last_slot=last
            )
            return session.slot, False
        if self.snapshots is None or head_sha is None or not chat:
            return None, False
        slot = self.snapshots.pin(worker, session.id, body, returning=session.calls > 0)
        session.slot = slot
        return slot, slot is not None

    def finished(self, worker: str, session: Session, evidence: CallEvidence | None) -> None:
        """A snapshot-pinned call is over: its slot is saved when the server judged it whole."""
        if self.snapshots is None or session.slot is None:
            return
        ok = evidence is not None and evidence.cache_state != "unverified" and evidence.complete
        prompt = evidence.prompt_tokens if ok and evidence is not None else None
        completion = evidence.completion_tokens if evidence is not None else None
        self.snapshots.finished(worker, session.slot, session.id, prompt, completion)

    def snapshots_cover(self, worker: str) -> bool:
        """Whether `worker`'s sessions are kept by snapshots, not by the re-warm keeper."""
        return self.snapshots is not None and self.snapshots.covers(worker)

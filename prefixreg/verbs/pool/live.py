"""`Pool`: a configured pool (`prefixreg.verbs.pool.spec`) with live clients, for loops and verbs.

- `survey()` reads each worker's build (fresh, DESIGN §3 rule 3), its size (llama.cpp
  `total_slots`; Halogen `/cache` `max_entries` over the entries one request stores), the
  latest verified `probe --survival` for that exact build, and its capacity.
- `worker_for(ref)` is the worker holding a placed prefix (loops without a router);
  `headers_for(ref)` is the routing header that leads the router there; `chat(ref, tail)`
  sends one call the right way (router with its key, else the worker directly).
- `served_marks()` fingerprints what each worker has served (llama.cpp `/slots` `id_task`,
  else Halogen `/cache` hits + misses), so a call through the router can be traced to the
  worker that served it: the router hides its workers' slots.

Invariants: a prefix not in the placement has no worker (`UsageError`, never a guess); the
placement records the build a prefix was proven on; clients are closed by `close()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from prefixreg.core.errors import PrefixregError, UsageError, WorkerError
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import CallEvidence, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.server.counters import MEASURED_ENTRIES_PER_REQUEST
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.budget import latest_survival
from prefixreg.verbs.pool.spec import (
    ROUTING_KEY_HEADER,
    Assignment,
    PoolSpec,
    capacity_of,
    load_placement,
    save_placement,
)

__all__ = ["Pool", "WorkerState"]

Mark = tuple[JSONValue, ...] | None


@dataclass(frozen=True, slots=True)
class WorkerState:
    """What one worker said about itself just now, and what it can keep."""

    url: str
    build: ServerBuild | None
    slots: int | None
    slots_source: str
    survival: int | None
    capacity: int
    error: str | None = None

    @property
    def build_id(self) -> str | None:
        return None if self.build is None else self.build.build_id

    def to_dict(self) -> JSONObject:
        return {
            "url": self.url,
            "profile": None if self.build is None else self.build.profile,
            "build_id": self.build_id,
            "slots": self.slots,
            "slots_source": self.slots_source,
            "survival": self.survival,
            "capacity": self.capacity,
            "error": self.error,
        }


class Pool:
    """Live clients for a pool's workers (and router), with its kept placement."""

    def __init__(
        self,
        spec: PoolSpec,
        registry: Registry,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        read_timeout: float = 1800.0,
    ) -> None:
        self.spec = spec
        self.registry = registry
        opts: dict[str, Any] = {"api_key": api_key, "timeout": timeout}
        self.workers = {
            w.url: Worker(w.url, read_timeout=read_timeout, **opts) for w in spec.workers
        }
        self.router = (
            None
            if spec.router is None
            else Worker(spec.router, read_timeout=read_timeout, profile="generic", **opts)
        )
        self.placement: dict[str, Assignment] = load_placement(spec.placement_path)

    def __enter__(self) -> Pool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        if self.router is not None:
            self.router.close()

    # ------------------------------------------------------------------ what each can keep

    def survey(self) -> list[WorkerState]:
        """Each worker's build, size, measured survival and capacity, read now."""
        return [self._state(spec.url, spec.capacity) for spec in self.spec.workers]

    def _state(self, url: str, cap: int | None) -> WorkerState:
        worker = self.workers[url]
        try:
            build = worker.server_build()
            slots, source = self._size(worker, build)
        except WorkerError as exc:
            return WorkerState(url, None, None, "unreachable", None, 0, str(exc))
        measured = latest_survival(self.registry, build)
        survival = None if measured is None else measured[0]
        return WorkerState(url, build, slots, source, survival, capacity_of(slots, survival, cap))

    @staticmethod
    def _size(worker: Worker, build: ServerBuild) -> tuple[int | None, str]:
        if build.profile == "llamacpp":
            total = build.identity.get("total_slots")
            if type(total) is int and total > 0:
                return total, "/props total_slots"
        if build.profile == "halogen":
            counters = worker.cache()
            if counters is not None and counters.max_entries:
                per = MEASURED_ENTRIES_PER_REQUEST
                return max(counters.max_entries // per, 1), f"/cache max_entries / {per}"
        return None, "not reported (1 assumed)"

    # ------------------------------------------------------------------ where a prefix is

    def assignment(self, ref: str) -> Assignment:
        sha = self.registry.resolve(ref)
        found = self.placement.get(sha)
        if found is None or found.worker not in self.workers:
            raise UsageError(
                f"prefix {sha[:12]} is not placed on this pool",
                hint="run `prefixreg pool warm REF` first",
            )
        return found

    def worker_for(self, ref: str) -> Worker:
        """The worker that holds `ref` (a name, sha or sha prefix)."""
        return self.workers[self.assignment(ref).worker]

    def routing_key(self, ref: str) -> str:
        return self.assignment(ref).key

    def headers_for(self, ref: str) -> dict[str, str]:
        """The header that makes the router send `ref`'s calls where it is resident."""
        return {ROUTING_KEY_HEADER: self.routing_key(ref)}

    def chat(self, ref: str, tail: str, **params: Any) -> tuple[JSONObject, CallEvidence]:
        """One call for `ref` (verified bytes): through the router with its key, else direct."""
        prefix = self.registry.get(ref)
        if self.router is not None:
            return self.router.chat(prefix, tail, headers=self.headers_for(ref), **params)
        return self.worker_for(ref).chat(prefix, tail, **params)

    def save(self) -> None:
        """Keep the placement (nothing to do for a pool without a placement file)."""
        if self.spec.placement_path is not None:
            save_placement(self.spec.placement_path, self.spec, self.placement.values())

    # ------------------------------------------------------------------ tracing a call

    def served_marks(self) -> dict[str, Mark]:
        """Per worker, a value that changes exactly when it serves a completion."""
        return {url: _mark(worker) for url, worker in self.workers.items()}


def _mark(worker: Worker) -> Mark:
    try:
        slots = worker.slots()
        if slots is not None:
            return tuple(s.get("id_task") for s in slots)
        counters = worker.cache_raw()
    except PrefixregError:
        return None
    if isinstance(counters, Mapping):
        return (counters.get("hits"), counters.get("misses"))
    return None


def served_by(before: Mapping[str, Mark], after: Mapping[str, Mark]) -> str | None:
    """The one worker whose mark moved, or None (none or several moved, or no marks)."""
    moved = [u for u in after if after[u] is not None and before.get(u) != after[u]]
    return moved[0] if len(moved) == 1 else None

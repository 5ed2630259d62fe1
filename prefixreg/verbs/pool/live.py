"""`Pool`: a configured pool (`.spec`) with live clients, for loops and verbs.

`survey()` reads each worker's build fresh (DESIGN §3 rule 3), its size, its latest verified
`probe --survival` and its capacity (the rule is `spec`'s: heads used in any order, counting the
entries each call of a head, a proof's check included, stores in an LRU they share);
`worker_for`, `headers_for` and `chat` take a head or a reference they resolve (a direct
`chat` is read by the build the last survey read of its worker: `builds`);
`served_marks()` fingerprints what each worker served (`/slots` `id_task`, else `/cache`
hits + misses), since the router hides its workers.

Invariants: a head not in the placement has no worker (`UsageError`, never a guess); the
kept placement is read once and each placed head resolved once, and an entry whose head
left the registry is dropped with a warning (`warnings`); clients are closed by `close()`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from prefixreg.core.errors import PrefixregError, RefNotFoundError, UsageError, WorkerError
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CallEvidence, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.registry.userfiles import check_output_file
from prefixreg.server.counters import MEASURED_ENTRIES_PER_REQUEST
from prefixreg.server.transport import check_seconds
from prefixreg.server.worker import Worker
from prefixreg.verbs.measure.budget import latest_survival
from prefixreg.verbs.pool.spec import (
    ROUTING_KEY_HEADER,
    Assignment,
    PoolSpec,
    capacity_of,
    default_placement,
    load_placement,
    lru_heads,
    save_placement,
)

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
        fields = ("url", "build_id", "slots", "slots_source", "survival", "capacity", "error")
        out: JSONObject = {f: getattr(self, f) for f in fields}
        out["profile"] = None if self.build is None else self.build.profile
        return out


class Pool:
    """Live clients for a pool's workers (and router), with its kept placement.

    Raises:
        UsageError: a wrong type or value, or a placement path holding no placement file.
        IntegrityError: a placed head's bytes or record fail verification.
    """

    def __init__(
        self,
        spec: PoolSpec,
        registry: Registry,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        read_timeout: float = 1800.0,
    ) -> None:
        given: tuple[object, object] = (spec, registry)
        if not isinstance(given[0], PoolSpec) or not isinstance(given[1], Registry):
            raise UsageError("Pool takes a PoolSpec and a Registry")
        check_seconds("timeout", timeout)
        check_seconds("read_timeout", read_timeout)
        self.spec, self.registry = spec, registry
        self.placement_path = spec.placement_path or default_placement(registry.root, spec.pool_id)
        check_output_file(self.placement_path, "the pool's placement", parents=True)
        placement, self.warnings = load_placement(self.placement_path)
        self.heads: dict[str, Head] = {}  # each placed head, resolved once
        self.builds: dict[str, ServerBuild] = {}  # each worker's build, as `survey` last read it
        for sha in placement:
            try:
                self.heads[sha] = registry.head(sha)
            except RefNotFoundError:
                self.warnings.append(f"{sha[:12]} left the registry: dropped from the placement")
        self.placement = {s: a for s, a in placement.items() if s in self.heads}
        opts: dict[str, Any] = {"api_key": api_key, "timeout": timeout}
        opts["read_timeout"] = read_timeout
        self.workers = {w.url: Worker(w.url, **opts) for w in spec.workers}
        router = spec.router
        self.router = None if router is None else Worker(router, profile="generic", **opts)

    def __enter__(self) -> Pool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for worker in [*self.workers.values(), *([self.router] if self.router else [])]:
            worker.close()

    def survey(self) -> list[WorkerState]:
        """Each worker's build, size, measured survival and capacity, read now."""
        return [self._state(spec.url, spec.capacity) for spec in self.spec.workers]

    def _state(self, url: str, cap: int | None) -> WorkerState:
        worker = self.workers[url]
        try:
            build = self.builds[url] = worker.server_build()
            measured = latest_survival(self.registry, build)
            survival, per_call = (None, None) if measured is None else measured[:2]
            per_call = _per_call(build, per_call)
            slots, source = self._size(worker, build, per_call)
        except WorkerError as exc:
            return WorkerState(url, None, None, "unreachable", None, 0, str(exc))
        if slots is None and survival is not None and per_call is not None:
            counted = measured is not None and measured[1] == per_call
            per = f"{per_call} entries a call" + ("" if counted else " assumed, none counted")
            source = f"not reported: heads in any order from survival {survival} ({per})"
        capacity = capacity_of(slots, survival, cap, per_call=per_call)
        return WorkerState(url, build, slots, source, survival, capacity)

    @staticmethod
    def _size(worker: Worker, build: ServerBuild, per_call: int | None) -> tuple[int | None, str]:
        """The heads the worker's size allows (`spec.capacity_of`), and where that comes from."""
        if build.profile == "llamacpp":
            total = build.identity.get("total_slots")
            if type(total) is int and total > 0:
                return total, "/props total_slots"
        if build.profile == "halogen" and per_call is not None:
            counters = worker.cache()
            if counters is not None and counters.max_entries:
                entries = counters.max_entries
                text = f"/cache max_entries {entries}: any order, {per_call} entries a call"
                return lru_heads(entries, per_call), text
        return None, "not reported (1 assumed)"

    def head(self, ref: Head | str) -> Head:
        """`ref` itself when it is a head, else the verified head it names."""
        if isinstance(ref, Prefix | Frame):
            return ref
        if not isinstance(ref, str):
            raise UsageError(f"a Prefix, a Frame or a reference, not {type(ref).__name__}")
        return self.registry.head(ref)

    def assignment(self, ref: Head | str) -> Assignment:
        sha = self.head(ref).sha256
        found = self.placement.get(sha)
        if found is None or found.worker not in self.workers:
            hint = "run `prefixreg pool warm REF` first"
            raise UsageError(f"{sha[:12]} is not placed on this pool", hint=hint)
        return found

    def worker_for(self, ref: Head | str) -> Worker:
        return self.workers[self.assignment(ref).worker]

    def headers_for(self, ref: Head | str) -> dict[str, str]:
        """The header that makes the router send `ref`'s calls where it is resident."""
        return {ROUTING_KEY_HEADER: self.assignment(ref).key}

    def chat(self, ref: Head | str, tail: str, **params: Any) -> tuple[JSONObject, CallEvidence]:
        """One call for `ref` (verified bytes): through the router with its key, else direct."""
        head = self.head(ref)
        if self.router is not None:
            return self.router.chat(head, tail, headers=self.headers_for(head), **params)
        url = self.assignment(head).worker
        return self.workers[url].chat(head, tail, build=self.builds.get(url), **params)

    def save(self) -> None:
        save_placement(self.placement_path, self.spec, self.placement.values())

    def served_marks(self) -> dict[str, Mark]:
        """Per worker, a value that changes exactly when it serves a completion."""
        return {url: _mark(worker) for url, worker in self.workers.items()}


def _per_call(build: ServerBuild, measured: int | None) -> int | None:
    """Entries one call stores in the LRU the heads share (`spec` module: the capacity rule);
    None on llama.cpp, whose heads each have a slot."""
    if build.profile == "llamacpp":
        return None
    if measured is not None and measured > 0:
        return measured  # the probe counted them (`stores_per_prompt`)
    return MEASURED_ENTRIES_PER_REQUEST if build.profile == "halogen" else 1


def _mark(worker: Worker) -> Mark:
    try:
        slots = worker.slots()
        if slots is not None:
            return tuple(s.get("id_task") for s in slots)
        counters = worker.cache_raw()
    except PrefixregError:
        return None
    return (counters.get("hits"), counters.get("misses")) if isinstance(counters, Mapping) else None


def served_by(before: Mapping[str, Mark], after: Mapping[str, Mark]) -> str | None:
    """The one worker whose mark moved, or None (none or several moved, or no marks)."""
    moved = [u for u in after if after[u] is not None and before.get(u) != after[u]]
    return moved[0] if len(moved) == 1 else None

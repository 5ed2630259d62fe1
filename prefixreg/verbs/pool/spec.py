"""A pool of workers (optionally behind a router): who they are, what each can keep, where
each registered prefix lives.

Where a pool comes from, first match wins: `--worker URL` repeated, a pool file (`--pool
FILE`), `PREFIXREG_WORKERS` (comma-separated URLs). A pool file is TOML (`.toml`) or JSON
(anything else), never inside a registry:

    router = "http://127.0.0.1:30000"        # optional: sglang-router in front of the workers
    placement = "pool.placement.json"       # optional; default: <pool file>.placement.json
                                            # (flags, env: <state dir>/prefixreg/pools/<id>.json)
    [[workers]]
    url = "http://127.0.0.1:8080"
    capacity = 1                            # optional: keep at most this many prefixes here
    [[workers]]
    url = "http://127.0.0.1:8081"

(JSON: `{"router": ..., "workers": [{"url": ..., "capacity": ...}, "http://..."]}`.)

A worker's capacity (`capacity_of`) is the number of registered prefixes it can keep
resident at once: its slots (llama.cpp `/props` `total_slots`) or its LRU's entries divided
by the entries one request stores (Halogen `/cache` `max_entries`), capped by the measured
survival of the latest `probe --survival` receipt for that exact build (k prefixes used in
turn each see k-1 foreign prompts between uses: k <= survival + 1), capped by the pool
file's `capacity`. A worker whose size nobody reports keeps 1.

Invariants:
- `place` never puts more prefixes on a worker than its capacity; what does not fit is
  returned as `refused`, in the order given, and nothing is sent for it.
- With a router, a prefix's routing key is its sha (header `x-smg-routing-key`); a re-keyed
  prefix gets `<sha>.<n>`. The placement (prefix -> worker, key, build) is kept in a small
  JSON file outside the registry, written whole (temp file + rename).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import orjson
import platformdirs

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject

__all__ = [
    "PLACEMENT_FORMAT",
    "ROUTING_KEY_HEADER",
    "WORKERS_ENV",
    "Assignment",
    "PlacementPlan",
    "PoolSpec",
    "WorkerSpec",
    "capacity_of",
    "load_placement",
    "parse_pool_file",
    "place",
    "pool_spec",
    "routing_key",
    "save_placement",
]

WORKERS_ENV: Final = "PREFIXREG_WORKERS"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"
PLACEMENT_FORMAT: Final = "prefixreg-pool-placement"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as configured: its URL and an optional cap on the prefixes it keeps."""

    url: str
    capacity: int | None = None


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The pool as configured: workers, the router in front of them, where placement lives."""

    workers: tuple[WorkerSpec, ...]
    router: str | None = None
    placement_path: Path | None = None
    source: str = "flags"

    @property
    def pool_id(self) -> str:
        """A short stable id of this set of workers and router (names a placement file)."""
        text = "\n".join([self.router or "", *sorted(w.url for w in self.workers)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _norm_url(url: object, where: str) -> str:
    if not isinstance(url, str) or not url.strip().startswith(("http://", "https://")):
        raise UsageError(f"{where}: a worker URL must start with http:// or https://, not {url!r}")
    return url.strip().rstrip("/")


def _worker_entry(entry: object, where: str) -> WorkerSpec:
    if isinstance(entry, str):
        return WorkerSpec(_norm_url(entry, where))
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: each worker is a URL or a table with `url`")
    unknown = set(entry) - {"url", "capacity"}
    if unknown:
        raise UsageError(f"{where}: unknown worker field(s) {', '.join(sorted(unknown))}")
    cap = entry.get("capacity")
    if cap is not None and (type(cap) is not int or cap < 0):
        raise UsageError(f"{where}: capacity must be a whole number >= 0, not {cap!r}")
    return WorkerSpec(_norm_url(entry.get("url"), where), cap)


def parse_pool_file(path: Path) -> PoolSpec:
    """Read a pool file (TOML when it ends in `.toml`, else JSON); a bad one is a UsageError."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read pool file {path}: {exc.strerror or exc}") from None
    try:
        data: object = (
            tomllib.loads(raw.decode("utf-8")) if path.suffix == ".toml" else orjson.loads(raw)
        )
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, orjson.JSONDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"pool file {path} does not parse: {first}") from None
    if not isinstance(data, dict):
        raise UsageError(f"pool file {path}: the top level must be a table/object")
    unknown = set(data) - {"router", "workers", "placement"}
    if unknown:
        raise UsageError(f"pool file {path}: unknown field(s) {', '.join(sorted(unknown))}")
    entries = data.get("workers")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"pool file {path}: `workers` must list at least one worker")
    workers = tuple(_worker_entry(e, f"pool file {path}") for e in entries)
    router = data.get("router")
    placement = data.get("placement")
    if placement is not None and not isinstance(placement, str):
        raise UsageError(f"pool file {path}: `placement` must be a path")
    return _checked(
        PoolSpec(
            workers=workers,
            router=None if router is None else _norm_url(router, f"pool file {path}"),
            placement_path=(path.parent / placement) if placement else _sibling(path),
            source=str(path),
        )
    )


def _sibling(path: Path) -> Path:
    return path.with_name(path.name + ".placement.json")


def _checked(spec: PoolSpec) -> PoolSpec:
    urls = [w.url for w in spec.workers]
    dupes = sorted({u for u in urls if urls.count(u) > 1})
    if dupes:
        raise UsageError(f"a worker is listed twice: {', '.join(dupes)}")
    if spec.router is not None and spec.router in urls:
        raise UsageError(f"the router {spec.router} is also listed as a worker")
    return spec


def pool_spec(
    workers: Sequence[str] = (),
    *,
    pool_file: Path | None = None,
    router: str | None = None,
    env: Mapping[str, str] | None = None,
) -> PoolSpec:
    """The pool from `--worker` flags, else a pool file, else `PREFIXREG_WORKERS`.

    `router` (`--router`) overrides a pool file's router.
    """
    env = os.environ if env is None else env
    if workers:
        spec = PoolSpec(tuple(WorkerSpec(_norm_url(u, "--worker")) for u in workers))
    elif pool_file is not None:
        spec = parse_pool_file(pool_file)
    elif env.get(WORKERS_ENV, "").strip():
        urls = [u for u in env[WORKERS_ENV].split(",") if u.strip()]
        spec = PoolSpec(tuple(WorkerSpec(_norm_url(u, WORKERS_ENV)) for u in urls), source="env")
    else:
        raise UsageError(
            f"no pool: give --worker URL (repeated), --pool FILE, or set {WORKERS_ENV}"
        )
    if router is not None:
        spec = replace(spec, router=_norm_url(router, "--router"))
    if spec.placement_path is None:
        # Flags or the environment: the placement is kept per pool in the user's state dir.
        state = Path(platformdirs.user_state_dir("prefixreg"))
        spec = replace(spec, placement_path=state / "pools" / f"{spec.pool_id}.json")
    return _checked(spec)


def capacity_of(slots: int | None, survival: int | None = None, cap: int | None = None) -> int:
    """How many registered prefixes a worker keeps resident at once (module docstring)."""
    room = slots if slots is not None and slots > 0 else 1
    if survival is not None:
        room = min(room, survival + 1)
    if cap is not None:
        room = min(room, cap)
    return max(room, 0)


def routing_key(sha256: str, attempt: int = 0) -> str:
    """The router's key for a prefix: its sha; `<sha>.<n>` after `n` re-keyings."""
    return sha256 if attempt == 0 else f"{sha256}.{attempt}"


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where one prefix lives: the worker, the router key that leads there, the build."""

    sha256: str
    worker: str
    key: str
    build_id: str | None = None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "worker": self.worker,
            "key": self.key,
            "build_id": self.build_id,
        }


@dataclass(slots=True)
class PlacementPlan:
    """`place`'s answer: prefix -> worker for what fits, and what was refused."""

    assigned: dict[str, str] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)

    def load(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for url in self.assigned.values():
            out[url] = out.get(url, 0) + 1
        return out


def place(
    shas: Iterable[str], capacity: Mapping[str, int], current: Mapping[str, str] | None = None
) -> PlacementPlan:
    """Assign each prefix to a worker without exceeding any worker's capacity.

    A prefix already placed (`current`) stays where it is while that worker has room (in the
    order given); the rest go to the worker with the most room left (ties: the order of
    `capacity`). A current placement that overloads its worker is `moved`; a prefix that
    fits nowhere is `refused`, and the prefixes listed first win.
    """
    wanted = list(dict.fromkeys(shas))
    plan = PlacementPlan()
    used = dict.fromkeys(capacity, 0)
    pending: list[str] = []
    for sha in wanted:
        where = (current or {}).get(sha)
        if where in used and used[where] < capacity[where]:
            plan.assigned[sha] = where
            used[where] += 1
        else:
            if where is not None:
                plan.moved.append(sha)
            pending.append(sha)
    for sha in pending:
        best = max(used, key=lambda url: capacity[url] - used[url], default=None)
        if best is None or capacity[best] - used[best] <= 0:
            plan.refused.append(sha)
            if sha in plan.moved:
                plan.moved.remove(sha)
            continue
        plan.assigned[sha] = best
        used[best] += 1
    return plan


def load_placement(path: Path | None) -> dict[str, Assignment]:
    """The kept placement, by sha; empty when there is none (a bad file is a UsageError)."""
    if path is None:
        return {}
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise UsageError(f"cannot read placement file {path}: {exc.strerror or exc}") from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UsageError(f"placement file {path} is not JSON") from None
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise UsageError(f"{path} is not a prefixreg placement file")
    out: dict[str, Assignment] = {}
    for entry in data.get("entries") or []:
        if not isinstance(entry, dict):
            continue
        sha, worker, key = entry.get("sha256"), entry.get("worker"), entry.get("key")
        build = entry.get("build_id")
        if isinstance(sha, str) and isinstance(worker, str) and isinstance(key, str):
            out[sha] = Assignment(sha, worker, key, build if isinstance(build, str) else None)
    return out


def save_placement(path: Path, spec: PoolSpec, entries: Iterable[Assignment]) -> None:
    """Write the placement whole: a temp file in the same directory, fsync, rename."""
    body: JSONObject = {
        "format": PLACEMENT_FORMAT,
        "version": 1,
        "router": spec.router,
        "workers": [w.url for w in spec.workers],
        "entries": [a.to_dict() for a in sorted(entries, key=lambda a: a.sha256)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".placement-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)  # the rename survives a power loss too
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

"""A pool of workers (optionally behind a router): who they are, what each can keep, where
each registered head lives.

Where a pool comes from, first match wins: `--worker URL` repeated, a pool file (`--pool
FILE`), `PREFIXREG_WORKERS` (comma-separated URLs). A pool file is TOML (`.toml`) or JSON
(anything else), never inside a registry:

    router = "http://127.0.0.1:30000"        # optional: sglang-router in front of the workers
    placement = "pool.placement.json"       # optional; default: <pool file>.placement.json
    [[workers]]                             # (flags, env: <registry>.pools/<pool id>.json)
    url = "http://127.0.0.1:8080"
    capacity = 1                            # optional: keep at most this many heads here
    [[workers]]
    url = "http://127.0.0.1:8081"

(JSON: `{"router": ..., "workers": [{"url": ..., "capacity": ...}, "http://..."]}`.)

A worker's capacity (`capacity_of`) is the number of heads it can keep resident at once: its
slots (llama.cpp `/props` `total_slots`) or its LRU's entries over the entries one request
stores (Halogen `/cache` `max_entries`), capped by the latest `probe --survival` for that
exact build (k heads used in turn each see k-1 foreign prompts: k <= survival + 1), capped by
the pool file's `capacity`. A worker whose size nobody reports keeps 1.

Invariants:
- A worker is one identity: scheme, resolved host, port, path without `/v1` (`U` and
  `U/v1`, `localhost` and `127.0.0.1`, port `019102` and `19102` are one worker). Two
  spellings of one worker, an empty list, a blank entry or user info in a URL are refused
  (`UsageError`), wherever the list comes from.
- `place` never puts more heads on a worker than its capacity; what does not fit is
  `refused`, in the order given, and nothing is sent for it.
- With a router, a head's routing key is its sha (header `x-smg-routing-key`); a re-keyed
  head gets `<sha>.<n>`. The placement (head -> worker, key, build) is a small JSON file
  outside the registry, written whole by the registry's durable writer. An entry that does
  not parse is dropped with a warning; a file that is not a placement is refused (never
  overwritten).
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import stat
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

from prefixreg.core.digest import is_full_sha
from prefixreg.core.errors import PrefixregError, UsageError
from prefixreg.core.jsonio import dumps_pretty, loads
from prefixreg.registry.fsutil import replace_atomic
from prefixreg.server.transport import display_url

WORKERS_ENV: Final = "PREFIXREG_WORKERS"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"
PLACEMENT_FORMAT: Final = "prefixreg-pool-placement"
MAX_FILE_BYTES: Final = 1 << 20  # a pool or placement file is a few KiB


def worker_url(url: object, where: str = "worker") -> str:
    """The canonical spelling of a worker URL: no trailing `/` or `/v1`, the port a number."""
    if not isinstance(url, str):
        raise UsageError(f"{where}: a worker URL is a string, not {type(url).__name__}")
    base = url.strip().rstrip("/").removesuffix("/v1")
    try:
        parts = urlsplit(base)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number in 1..65535
        ok, parts = False, urlsplit("")
    if not ok:
        raise UsageError(f"{where}: a worker URL is http://host[:port] or https://..., not {url[:80]!r}")
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"{where}: no user info in a worker URL (use PREFIXREG_API_KEY)")
    return display_url(base)


@functools.lru_cache(maxsize=64)
def _addresses(host: str, port: int) -> frozenset[str]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset({host})  # unresolvable: the name is all we know
    return frozenset({host, *(str(info[4][0]) for info in found)})


def same_worker(a: str, b: str) -> bool:
    """Whether two canonical worker URLs name one server (scheme, address, port, path)."""
    if a == b:
        return True
    pa, pb = urlsplit(a), urlsplit(b)
    default = {"http": 80, "https": 443}
    ports = (pa.port or default[pa.scheme], pb.port or default[pb.scheme])
    if (pa.scheme, pa.path) != (pb.scheme, pb.path) or ports[0] != ports[1]:
        return False  # resolve only what could collide
    return bool(_addresses(pa.hostname or "", ports[0]) & _addresses(pb.hostname or "", ports[1]))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as configured: its canonical URL and an optional cap on the heads it keeps."""

    url: str
    capacity: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", worker_url(self.url))
        cap = self.capacity
        if cap is not None and (type(cap) is not int or cap < 0):
            raise UsageError(f"capacity must be a whole number >= 0, not {cap!r}")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The pool as configured: workers, the router in front of them, where placement lives
    (None: beside the registry, `default_placement`)."""

    workers: tuple[WorkerSpec, ...]
    router: str | None = None
    placement_path: Path | None = None
    source: str = "flags"

    def __post_init__(self) -> None:
        workers: object = self.workers
        if not isinstance(workers, tuple | list) or not workers:
            raise UsageError("a pool lists at least one worker")
        if not all(isinstance(w, WorkerSpec) for w in workers):
            raise UsageError("a pool's workers are WorkerSpec values")
        object.__setattr__(self, "workers", tuple(workers))
        if self.router is not None:
            object.__setattr__(self, "router", worker_url(self.router, "router"))
        if self.placement_path is not None and not isinstance(self.placement_path, Path):
            raise UsageError("placement_path is a Path or None")
        for a, b in combinations([w.url for w in self.workers], 2):
            if same_worker(a, b):
                raise UsageError(f"a worker is listed twice: {a} and {b} are one worker")
        for w in self.workers:
            if self.router is not None and same_worker(self.router, w.url):
                raise UsageError(f"the router {self.router} is also listed as a worker")

    @property
    def pool_id(self) -> str:
        """A short stable id of this set of workers and router (names a placement file)."""
        text = "\n".join([self.router or "", *sorted(w.url for w in self.workers)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_small(path: Path, what: str) -> bytes | None:
    """A small regular file the user named (None: it does not exist); else a UsageError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(f"{what} {path} is not a regular file")
    with os.fdopen(fd, "rb") as handle:
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{what} {path} is over {MAX_FILE_BYTES >> 10} KiB")
    return data


def parse_pool_file(path: Path) -> PoolSpec:
    """Read a pool file (TOML when it ends in `.toml`, else JSON); a bad one is a UsageError."""
    raw = read_small(path, "pool file")
    if raw is None:
        raise UsageError(f"cannot read pool file {path}: no such file")
    try:
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else loads(raw)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, PrefixregError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"pool file {path} does not parse: {first}") from None
    try:
        if not isinstance(data, dict):
            raise UsageError("the top level must be a table/object")
        unknown = set(data) - {"router", "workers", "placement"}
        if unknown:
            raise UsageError(f"unknown field(s) {', '.join(sorted(unknown))}")
        entries, placement = data.get("workers"), data.get("placement")
        if not isinstance(entries, list) or not entries:
            raise UsageError("`workers` must list at least one worker")
        if placement is not None and not isinstance(placement, str):
            raise UsageError("`placement` must be a path")
        return PoolSpec(
            workers=tuple(_worker_entry(e) for e in entries),
            router=data.get("router"),  # type: ignore[arg-type]  # PoolSpec checks it
            placement_path=path.parent / (placement or path.name + ".placement.json"),
            source=str(path),
        )
    except UsageError as exc:
        raise UsageError(f"pool file {path}: {exc}") from None


def _worker_entry(entry: object) -> WorkerSpec:
    if isinstance(entry, str):
        return WorkerSpec(entry)
    if not isinstance(entry, dict):
        raise UsageError("each worker is a URL or a table with `url`")
    unknown = set(entry) - {"url", "capacity"}
    if unknown:
        raise UsageError(f"unknown worker field(s) {', '.join(sorted(unknown))}")
    return WorkerSpec(entry.get("url"), entry.get("capacity"))  # type: ignore[arg-type]


def pool_spec(
    workers: Sequence[str] = (),
    *,
    pool_file: Path | None = None,
    router: str | None = None,
    env: Mapping[str, str] | None = None,
) -> PoolSpec:
    """The pool from `--worker` flags, else a pool file, else `PREFIXREG_WORKERS`;
    `router` (`--router`) overrides a pool file's router."""
    env = os.environ if env is None else env
    listed = env.get(WORKERS_ENV, "")
    if workers:
        spec = PoolSpec(tuple(WorkerSpec(u) for u in workers))
    elif pool_file is not None:
        spec = parse_pool_file(pool_file)
    elif listed.strip():
        urls = [u.strip() for u in listed.split(",")]
        if not all(urls):
            raise UsageError(f"{WORKERS_ENV} has a blank entry: {listed!r}")
        spec = PoolSpec(tuple(WorkerSpec(u) for u in urls), source="env")
    else:
        raise UsageError(
            f"no pool: give --worker URL (repeated), --pool FILE, or set {WORKERS_ENV}"
        )
    return spec if router is None else replace(spec, router=router)


def default_placement(registry_root: Path, pool_id: str) -> Path:
    """Where a pool from flags or the environment keeps its placement: beside the registry
    it names heads of (`<registry>.pools/<pool id>.json`), so it follows the registry's
    location rule (`--registry`, `$PREFIXREG_HOME`, the XDG state directory)."""
    return registry_root.with_name(registry_root.name + ".pools") / f"{pool_id}.json"


def capacity_of(slots: int | None, survival: int | None = None, cap: int | None = None) -> int:
    """How many heads a worker keeps resident at once (module docstring)."""
    room = slots if slots is not None and slots > 0 else 1
    if survival is not None:
        room = min(room, survival + 1)
    if cap is not None:
        room = min(room, cap)
    return max(room, 0)


def routing_key(sha256: str, attempt: int = 0) -> str:
    """The router's key for a head: its sha; `<sha>.<n>` after `n` re-keyings."""
    return sha256 if attempt == 0 else f"{sha256}.{attempt}"


@dataclass(frozen=True, slots=True)
class Assignment:
    """Where one head lives: the worker, the router key that leads there, the build."""

    sha256: str
    worker: str
    key: str
    build_id: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return asdict(self)


@dataclass(slots=True)
class PlacementPlan:
    """`place`'s answer: head -> worker for what fits, what was refused, what moved."""

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
    """Assign each head to a worker without exceeding any worker's capacity.

    A head already placed (`current`) stays while its worker has room (in the order
    given); the rest go to the worker with the most room left (ties: the order of
    `capacity`). A current placement that overloads its worker is `moved`; a head that
    fits nowhere is `refused`, and the heads listed first win.
    """
    plan = PlacementPlan()
    used = dict.fromkeys(capacity, 0)
    pending: list[str] = []
    for sha in dict.fromkeys(shas):
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


def _assignment(entry: object) -> Assignment:
    if not isinstance(entry, dict):
        raise UsageError("not an object")
    sha, key, build = entry.get("sha256"), entry.get("key"), entry.get("build_id")
    if not isinstance(sha, str) or not is_full_sha(sha):
        raise UsageError(f"sha256 {str(sha)[:16]!r} is not a full sha")
    if not isinstance(key, str) or key.partition(".")[0] != sha:
        raise UsageError(f"key {str(key)[:16]!r} is not a routing key of {sha[:12]}")
    if build is not None and not isinstance(build, str):
        raise UsageError("build_id is not a string")
    return Assignment(sha, worker_url(entry.get("worker")), key, build)


def load_placement(path: Path) -> tuple[dict[str, Assignment], list[str]]:
    """The kept placement by sha, and a warning per entry dropped because it does not parse.

    Raises:
        UsageError: the file is not a placement file (it is never overwritten then).
    """
    raw = read_small(path, "placement file")
    if raw is None:
        return {}, []
    try:
        data = loads(raw, path=path)
    except PrefixregError:
        raise UsageError(f"placement file {path} is not JSON", hint="move it away") from None
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise UsageError(f"{path} is not a prefixreg placement file", hint="move it away")
    entries = data.get("entries") or []
    out: dict[str, Assignment] = {}
    warnings: list[str] = []
    for n, entry in enumerate(entries if isinstance(entries, list) else [entries]):
        try:
            a = _assignment(entry)
        except UsageError as exc:
            warnings.append(f"placement file {path}: entry {n} dropped ({exc})")
            continue
        out[a.sha256] = a
    return out, warnings


def save_placement(path: Path, spec: PoolSpec, entries: Iterable[Assignment]) -> None:
    """Write the placement whole, durably (`registry.fsutil.replace_atomic`)."""
    body = {
        "format": PLACEMENT_FORMAT,
        "version": 1,
        "router": spec.router,
        "workers": [w.url for w in spec.workers],
        "entries": [a.to_dict() for a in sorted(entries, key=lambda a: a.sha256)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomic(path, dumps_pretty(body))

"""A pool of workers (optionally behind a router): who they are, what each keeps, where each
head lives. A pool comes from `--worker URL` repeated, else a pool file (`--pool FILE`: TOML
if it ends in `.toml`, else JSON), else `PREFIXREG_WORKERS` (comma-separated URLs):

    router = "http://127.0.0.1:30000"      # optional: sglang-router in front of the workers
    placement = "pool.placement.json"     # optional; default <pool file>.placement.json
    [[workers]]                           # (flags, env: <registry>.pools/<pool id>.json)
    url = "http://127.0.0.1:8080"
    capacity = 1                          # optional: keep at most this many heads here

Invariants:
- A worker is one identity: its canonical URL (`server.urls`: `U`, `U/v1`, `U/.`,
  `[::ffff:127.0.0.1]` and `127.0.0.1`, `:019102` and `:19102` are one), then its resolved
  host (`localhost` and `127.0.0.1`). Two spellings of one worker are refused, naming both
  (a demanding user listed it twice by mistake: counting it once would hide the mistake, and
  counting it twice promises heads it cannot keep); so are no worker, a blank entry, user
  info, a query or fragment, a control character or space, and 0.0.0.0 (`UsageError`).
- `place` never puts more heads on a worker than its capacity (`capacity_of`); what fits
  nowhere is `refused`, and nothing is sent for it.
- Capacity is the heads a worker keeps whatever order they are used in: a round of the
  user's own checks (each head once, any order) after a proof run (sha order), or a loop's
  calls, never evicts one. On llama.cpp each head has a slot: `total_slots`, capped by the
  measured survival (k <= survival + 1; a foreign head's second call lands in its own slot).
  Where the heads share one LRU of entries (Halogen `/cache`; vLLM, SGLang, TensorRT-LLM,
  Ollama), every call of a head, warm or check, stores p entries (the head's own snapshot,
  then its tail's) and refreshes the head's newest: after its own call a head has p-1
  entries above it. Between two of its calls in two rounds of any order (first in one, last
  in the next) the other k-1 heads each call twice: a first call puts p+1 entries above it
  (p stores and the refresh of an entry below it), a second p (its refreshed entry is above
  already). So an LRU of E entries keeps `lru_heads(E, p)` = 1 + (E-p)//(2p+1) heads (an
  8-entry Halogen at p = 2: 2; in one fixed order it would keep 3, and a user's check round
  in another order found one cold). A measured survival s (a just-used head outlives s
  foreign prompts of p entries: E >= (s+1)p) keeps `lru_heads((s+1)p, p)`, with p the
  probe's stores per prompt, else Halogen's measured 2, else 1 (an engine that counts no
  entries). Nothing reported and nothing measured: 1. A pool file's `capacity` caps it all.
- A head's routing key is its sha (`x-smg-routing-key`), `<sha>.<n>` once re-keyed. The
  placement (head -> worker, key, build) is a JSON file outside the registry, written whole
  by the registry's durable writer; an entry that does not parse is dropped with a warning,
  a file that is not a placement is refused (never overwritten). A pool or placement file
  is a small regular file (`userfiles.read_user_file`): a FIFO or a directory is refused.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import socket
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
from prefixreg.registry.userfiles import read_user_file
from prefixreg.server.urls import canonical_url, has_userinfo

WORKERS_ENV: Final = "PREFIXREG_WORKERS"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"
PLACEMENT_FORMAT: Final = "prefixreg-pool-placement"
MAX_FILE_BYTES: Final = 1 << 20  # a pool or placement file is a few KiB


def canonical_worker_url(url: object, where: str = "worker") -> str:
    """The canonical spelling of a worker URL (`server.urls.canonical_url`), user info refused."""
    canonical = canonical_url(url, where, keep_userinfo=True)
    if has_userinfo(canonical):
        raise UsageError(f"{where}: no user info in a worker URL (use PREFIXREG_API_KEY)")
    return canonical


def _folded(address: str) -> str:
    """An address as `canonical_url` spells it: an IPv4-mapped IPv6 address as its IPv4."""
    try:
        parsed = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped if mapped is not None else parsed)


@functools.lru_cache(maxsize=64)
def _addresses(host: str, port: int) -> frozenset[str]:
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset({host})  # unresolvable: the name is all we know
    return frozenset({host, *(_folded(str(info[4][0])) for info in found)})


def same_worker(a: str, b: str) -> bool:
    """Whether two canonical worker URLs name one server (scheme, address, port, path)."""
    pa, pb = urlsplit(a), urlsplit(b)
    port = {"http": 80, "https": 443}
    pa_port, pb_port = pa.port or port[pa.scheme], pb.port or port[pb.scheme]
    if (pa.scheme, pa.path, pa_port) != (pb.scheme, pb.path, pb_port):
        return False  # resolve only what could collide
    return bool(_addresses(pa.hostname or "", pa_port) & _addresses(pb.hostname or "", pb_port))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as configured: its canonical URL and an optional cap on the heads it keeps."""

    url: str
    capacity: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", canonical_worker_url(self.url))
        cap = self.capacity
        if cap is not None and (type(cap) is not int or cap < 0):
            raise UsageError(f"capacity must be a whole number >= 0, not {cap!r}")


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """The pool as configured: workers, the router in front of them, where the placement
    lives (None: beside the registry, `default_placement`)."""

    workers: tuple[WorkerSpec, ...]
    router: str | None = None
    placement_path: Path | None = None

    def __post_init__(self) -> None:
        given: object = self.workers
        if not isinstance(given, tuple | list) or not given:
            raise UsageError("a pool lists at least one worker")
        if not all(isinstance(w, WorkerSpec) for w in given):
            raise UsageError("a pool's workers are WorkerSpec values")
        if self.placement_path is not None and not isinstance(self.placement_path, Path):
            raise UsageError("placement_path is a Path or None")
        object.__setattr__(self, "workers", tuple(given))
        if self.router is not None:
            object.__setattr__(self, "router", canonical_worker_url(self.router, "router"))
        urls = [w.url for w in self.workers]
        for a, b in combinations(urls, 2):
            if same_worker(a, b):
                raise UsageError(f"a worker is listed twice: {a} and {b} are one worker")
        if self.router is not None and any(same_worker(self.router, u) for u in urls):
            raise UsageError(f"the router {self.router} is also listed as a worker")

    @property
    def pool_id(self) -> str:
        """A short stable id of this set of workers and router (names a placement file)."""
        text = "\n".join([self.router or "", *sorted(w.url for w in self.workers)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_small(path: Path, what: str) -> bytes | None:
    """A small regular file the user named (None: it does not exist). Raises: UsageError."""
    try:
        path.stat()
    except FileNotFoundError:
        return None
    except OSError:
        pass  # read_user_file says why
    try:
        return read_user_file(path.absolute(), limit=MAX_FILE_BYTES)  # never `-` (stdin)
    except UsageError as exc:
        raise UsageError(f"{what} {exc}") from None


def parse_pool_file(path: Path | str) -> PoolSpec:
    """Read a pool file (TOML when it ends in `.toml`, else JSON); a bad one is a UsageError."""
    given: object = path
    if not isinstance(given, Path | str):
        raise UsageError(f"a pool file is a path, not {type(given).__name__}")
    path = Path(path)
    if (raw := _read_small(path, "pool file")) is None:
        raise UsageError(f"cannot read pool file {path}: no such file")
    try:
        data = tomllib.loads(raw.decode()) if path.suffix == ".toml" else loads(raw)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, PrefixregError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"pool file {path} does not parse: {first}") from None
    try:
        if not isinstance(data, dict):
            raise UsageError("the top level must be a table/object")
        _known(data, {"router", "workers", "placement"}, "field")
        entries, placement = data.get("workers"), data.get("placement")
        if not isinstance(entries, list) or not entries:
            raise UsageError("`workers` must list at least one worker")
        if placement is not None and not isinstance(placement, str):
            raise UsageError("`placement` must be a path")
        workers = tuple(_worker_entry(e) for e in entries)
        at = path.parent / (placement or path.name + ".placement.json")
        return PoolSpec(workers, data.get("router"), at)  # type: ignore[arg-type]
    except UsageError as exc:
        raise UsageError(f"pool file {path}: {exc}") from None


def _known(table: Mapping[str, object], fields: set[str], what: str) -> None:
    if unknown := set(table) - fields:
        raise UsageError(f"unknown {what}(s) {', '.join(sorted(unknown))}")


def _worker_entry(entry: object) -> WorkerSpec:
    if isinstance(entry, str):
        return WorkerSpec(entry)
    if not isinstance(entry, dict):
        raise UsageError("each worker is a URL or a table with `url`")
    _known(entry, {"url", "capacity"}, "worker field")
    return WorkerSpec(entry.get("url"), entry.get("capacity"))  # type: ignore[arg-type]


def pool_spec(
    workers: Sequence[str] = (),
    *,
    pool_file: Path | str | None = None,
    router: str | None = None,
    env: Mapping[str, str] | None = None,
) -> PoolSpec:
    """The pool from `--worker` flags, else a pool file, else `PREFIXREG_WORKERS`;
    `router` (`--router`) overrides a pool file's router."""
    listed = (os.environ if env is None else env).get(WORKERS_ENV, "")
    if isinstance(workers, str | bytes) or not isinstance(workers, Sequence):
        raise UsageError(f"workers is a list of URLs, not {type(workers).__name__}")
    if workers:
        spec = PoolSpec(tuple(WorkerSpec(u) for u in workers))
    elif pool_file is not None:
        spec = parse_pool_file(pool_file)
    elif listed.strip():
        urls = [u.strip(" ") for u in listed.split(",")]
        if not all(urls):
            raise UsageError(f"{WORKERS_ENV} has a blank entry: {listed!r}")
        spec = PoolSpec(tuple(WorkerSpec(u) for u in urls))
    else:
        raise UsageError(f"no pool: give --worker URL (repeated), --pool FILE, or {WORKERS_ENV}")
    return spec if router is None else replace(spec, router=router)


def default_placement(registry_root: Path, pool_id: str) -> Path:
    """Where a pool from flags or the environment keeps its placement: beside the registry
    whose heads it names (`<registry>.pools/<pool id>.json`), following its location rule."""
    return registry_root.with_name(registry_root.name + ".pools") / f"{pool_id}.json"


def lru_heads(entries: int, per_call: int) -> int:
    """Heads an LRU of `entries` keeps checked in any order, each call storing `per_call`
    entries and refreshing one (the module's capacity rule): 1 + (entries - p) // (2p + 1)."""
    if type(entries) is not int or type(per_call) is not int or entries < 0 or per_call < 1:
        raise UsageError(f"lru_heads takes entries >= 0 and per_call >= 1, not {entries, per_call}")
    return max(0, 1 + (entries - per_call) // (2 * per_call + 1))


def capacity_of(
    slots: int | None,
    survival: int | None = None,
    cap: int | None = None,
    *,
    per_call: int | None = None,
) -> int:
    """How many heads a worker keeps resident at once (the module's capacity rule): `slots`,
    the heads its size allows (llama.cpp `total_slots`, or `lru_heads` of Halogen's
    `max_entries`; None: nobody says), capped by its measured survival and by the pool file's
    `capacity`. `per_call`: the entries one call stores when the heads share one LRU (None:
    each head has its own slot, so k heads each see at most k-1 other heads' prompts)."""
    room = 1 if slots is None else slots
    if survival is not None and per_call is not None:
        measured = lru_heads((survival + 1) * per_call, per_call)
        room = measured if slots is None else min(slots, measured)
    elif survival is not None:
        room = min(room, survival + 1)
    return max(room if cap is None else min(room, cap), 0)


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

    to_dict = asdict


@dataclass(slots=True)
class PlacementPlan:
    """`place`'s answer: head -> worker for what fits, what was refused, what moved."""

    assigned: dict[str, str] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)


def place(
    shas: Iterable[str], capacity: Mapping[str, int], current: Mapping[str, str] | None = None
) -> PlacementPlan:
    """Assign each head to a worker within every worker's capacity. A head already placed
    (`current`) stays while its worker has room (in the order given); the rest go to the worker
    with the most room left (ties: the order of `capacity`). A current placement that overloads
    its worker is `moved`; a head that fits nowhere is `refused`, the heads listed first win."""
    plan, room, current = PlacementPlan(), dict(capacity), current or {}
    pending: list[str] = []
    for sha in dict.fromkeys(shas):
        where = current.get(sha)
        if where is not None and room.get(where, 0) > 0:
            plan.assigned[sha] = where
            room[where] -= 1
        else:
            pending.append(sha)
    for sha in pending:
        best = max(room, key=room.__getitem__, default=None)
        if best is None or room[best] <= 0:
            plan.refused.append(sha)
            continue
        plan.assigned[sha] = best
        room[best] -= 1
        if sha in current:
            plan.moved.append(sha)
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
    return Assignment(sha, canonical_worker_url(entry.get("worker")), key, build)


def load_placement(path: Path) -> tuple[dict[str, Assignment], list[str]]:
    """The kept placement by sha, and a warning per entry dropped because it does not parse.

    Raises:
        UsageError: the file is not a placement file (it is never overwritten then).
    """
    if (raw := _read_small(path, "placement file")) is None:
        return {}, []
    try:
        data = loads(raw, path=path)
    except PrefixregError:
        raise UsageError(f"placement file {path} is not JSON", hint="move it away") from None
    if not isinstance(data, dict) or data.get("format") != PLACEMENT_FORMAT:
        raise UsageError(f"{path} is not a prefixreg placement file", hint="move it away")
    entries = data.get("entries") or []
    out: dict[str, Assignment] = {}
    warnings = []
    for n, entry in enumerate(entries if isinstance(entries, list) else [entries]):
        try:
            a = _assignment(entry)
        except UsageError as exc:
            warnings.append(f"placement file {path}: entry {n} dropped ({exc})")
        else:
            out[a.sha256] = a
    return out, warnings


def save_placement(path: Path, spec: PoolSpec, entries: Iterable[Assignment]) -> None:
    """Write the placement whole, durably (`registry.fsutil.replace_atomic`)."""
    body = {"format": PLACEMENT_FORMAT, "version": 1, "router": spec.router}
    body["workers"] = [w.url for w in spec.workers]
    body["entries"] = [a.to_dict() for a in sorted(entries, key=lambda a: a.sha256)]
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomic(path, dumps_pretty(body))

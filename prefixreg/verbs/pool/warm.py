"""`pool warm` and `pool doctor`: heads (prefixes or frames) on a pool, each proven resident
on the worker that holds it.

`warm_pool` surveys the workers and plans (`place`): placed heads keep their worker while it
has room; what fits nowhere is refused before anything is sent. With a router, each new
head's first call goes through it with its routing key and the serving worker is traced
(`served_marks`); a key that lands on a full worker is re-keyed (at most `MAX_REKEY` tries).
Then, per worker, rounds of fresh-tail checks *directly* on it (`warm`, check alone, bound
to that worker's build); a check that misses prefills (warms) its head, and the rounds
repeat until one prefills nothing (at most `PROOF_ROUNDS`).

Every proof run (warm's rounds, the doctor's one) checks a worker's heads in one fixed order,
by sha: a run leaves them least recently used in that order, so the next run proves them
least recently used first and, within capacity (`spec`: the capacity rule counts each
check's entries), a head's check evicts neither a head proven before it nor one waiting.

Invariants: a head is resident (`judge_resident`) only when its proof resumed and nothing
prefilled on its worker after it (a missed check may evict a head proven earlier); any
other is reported unproven (exit 1) and dropped from the kept placement. `doctor_pool`
proves the kept placement once, warms nothing, and flags builds that differ.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Final

from prefixreg.core.errors import PrefixregError, UsageError, WorkerError
from prefixreg.core.frame import Frame, Head
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.judge import judge_resident, judge_unproven
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.verbs.measure.calls import WARM_PARAMS
from prefixreg.verbs.measure.metrics import Metrics
from prefixreg.verbs.measure.warm import WarmResult, warm
from prefixreg.verbs.pool.live import Pool, WorkerState, served_by
from prefixreg.verbs.pool.spec import ROUTING_KEY_HEADER, Assignment, place, routing_key

MAX_REKEY: Final = 8
PROOF_ROUNDS: Final = 4

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Proof:
    """One placed head's last resume check on its worker, and whether it still stands."""

    sha256: str
    worker: str
    key: str
    verdict: str
    resident: bool
    reason: str
    cached_tokens: int | None
    span_tokens: int | None
    build_id: str


@dataclass(slots=True)
class PoolReport:
    """What `warm_pool` / `doctor_pool` found, per worker and per head."""

    workers: list[WorkerState]
    router: str | None
    proofs: list[Proof] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # placement dropped or missing
    asked: list[str] = field(default_factory=list)  # shas `warm_pool` was asked to place
    verb: str = "warm"  # whose rule `outcome` applies: warm, doctor (`doctor_pool`) or status

    @property
    def builds_differ(self) -> bool:
        return len({w.build_id for w in self.workers if w.build_id is not None}) > 1

    @property
    def ok(self) -> bool:
        """Every head asked for is placed and resident, and every worker answered: a head
        with no proof at all (untraced, out of re-keys, its check failed) is never ok."""
        resident = {p.sha256 for p in self.proofs if p.resident}
        every = all(p.resident for p in self.proofs) and resident.issuperset(self.asked)
        return every and not self.refused and all(w.error is None for w in self.workers)

    @property
    def unverified(self) -> bool:
        """Not ok only because a check's counts were unverified (exit 4, not 1)."""
        bad = [p for p in self.proofs if not p.resident]
        return bool(bad) and all(p.verdict == "unverified" for p in bad)

    @property
    def down(self) -> list[str]:
        """The workers that did not answer."""
        return [w.url for w in self.workers if w.error is not None]

    @property
    def outcome(self) -> str:
        """The verdict the exit code comes from. warm: `ok`, else `worker_error` when no
        worker answered, `unverified` when only unverified counts (and no refusal) stand in
        the way, `partial` otherwise; doctor: `healthy` when ok, one build and no note, else
        `unhealthy`; status: `worker_error` when a worker did not answer, else `ok`."""
        if self.verb == "doctor":
            healthy = self.ok and not self.builds_differ and not self.notes
            return "healthy" if healthy else "unhealthy"
        if self.verb == "status" or self.ok:
            return "worker_error" if self.down else "ok"
        if self.workers and len(self.down) == len(self.workers):
            return "worker_error"
        return "unverified" if self.unverified and not self.refused else "partial"

    def held_by(self, url: str) -> list[Proof]:
        return [p for p in self.proofs if p.worker == url]

    def to_dict(self) -> JSONObject:
        return {
            "ok": self.ok,
            "router": self.router,
            "builds_differ": self.builds_differ,
            "capacity": sum(w.capacity for w in self.workers),
            "workers": [
                {**w.to_dict(), "holds": [asdict(p) for p in self.held_by(w.url)]}
                for w in self.workers
            ],
            "refused": list(self.refused),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
        }

    def metrics(self, command: str) -> Metrics:
        """This report as gauges (`--metrics-file`): per worker, per head, the pool's state."""
        out, run = Metrics(), {"command": command}
        out.set("prefixreg_pool_ok", float(self.ok), "1 when every head is resident", run)
        out.set("prefixreg_pool_refused_heads", len(self.refused), "Heads beyond capacity", run)
        out.set("prefixreg_pool_builds_differ", float(self.builds_differ), "1: builds differ", run)
        now = time.time()
        out.set("prefixreg_pool_last_run_timestamp_seconds", now, "Unix time of this run", run)
        for w in self.workers:
            at = run | {"worker": w.url}
            out.set("prefixreg_pool_worker_up", float(w.error is None), "1: answered", at)
            out.set("prefixreg_pool_worker_capacity_heads", w.capacity, "Heads it keeps", at)
        for p in self.proofs:
            at = run | {"worker": p.worker, "head": p.sha256[:16], "verdict": p.verdict}
            out.set("prefixreg_pool_head_resident", float(p.resident), "1: proven resident", at)
            if p.cached_tokens is not None:
                out.set("prefixreg_pool_head_cached_tokens", p.cached_tokens, "Its proof's", at)
        return out


def warm_pool(pool: Pool, heads: Sequence[Head], *, progress: Say | None = None) -> PoolReport:
    """Place `heads` (verified: `Registry.head`) within capacity, warm, prove each on its worker.

    Raises:
        UsageError: not a list of heads, or the registry is a mirror (nothing sent).
    """
    given: object = heads
    if not isinstance(given, list | tuple) or not all(isinstance(h, Prefix | Frame) for h in given):
        raise UsageError("warm_pool takes a list of Prefix or Frame (Registry.head)")
    _check(pool)
    say = progress or (lambda _msg: None)
    pool.registry.refuse_on_mirror("record measurements")
    pool.heads.update((h.sha256, h) for h in heads)
    asked = list(dict.fromkeys(h.sha256 for h in heads))
    report = PoolReport(pool.survey(), pool.spec.router, asked=asked, warnings=list(pool.warnings))
    capacity = {w.url: w.capacity for w in report.workers if w.error is None}
    kept = [sha for sha in pool.placement if sha not in asked]
    current = {sha: a.worker for sha, a in pool.placement.items()}
    plan = place([*kept, *asked], capacity, current)
    report.refused += plan.refused
    for sha in plan.refused:
        text = f"{sha[:12]} refused: the pool keeps {sum(capacity.values())} heads and they are "
        report.notes.append(text + "taken (nothing was sent; add a worker or drop a head)")
    placed: dict[str, Assignment] = {}
    for sha, url in plan.assigned.items():
        old = pool.placement.get(sha)
        if old is not None and old.worker == url:
            placed[sha] = old
        elif pool.router is None:
            placed[sha] = Assignment(sha, url, routing_key(sha))
    load = Counter(a.worker for a in placed.values())
    for sha in [s for s in plan.assigned if s not in placed]:  # through the router
        old = pool.placement.get(sha)
        start = 0 if old is None else _attempt_of(old.key) + 1
        if got := _route_first_call(pool, sha, start, capacity, load, report.notes.append, say):
            placed[sha] = got
            load[got.worker] += 1
    _prove(pool, placed, report, say, warm_missing=True)
    pool.placement = {p.sha256: placed[p.sha256] for p in report.proofs if p.resident}
    pool.save()
    return report


def _check(pool: object) -> None:
    if not isinstance(pool, Pool):
        raise UsageError(f"a Pool, not {type(pool).__name__}")


def _attempt_of(key: str) -> int:
    _, dot, n = key.partition(".")
    return int(n) if dot and n.isdigit() else 0


def _route_first_call(
    pool: Pool, sha: str, start: int, caps: dict[str, int], load: Counter[str], note: Say, say: Say
) -> Assignment | None:
    """Send `sha`'s first call through the router; keep the key if it landed with room."""
    assert pool.router is not None  # noqa: S101 -- only called with a router
    for attempt in range(start, start + MAX_REKEY):
        key = routing_key(sha, attempt)
        before = pool.served_marks()
        pool.router.chat(
            pool.heads[sha], fresh_tail(), headers={ROUTING_KEY_HEADER: key}, **WARM_PARAMS
        )
        where = served_by(before, pool.served_marks())
        if where is None:
            text = f"{sha[:12]}: cannot tell which worker served key {key} (no /slots or /cache, "
            note(text + "or other traffic); not placed")
            return None
        if load[where] < caps.get(where, 0):
            say(f"{sha[:12]} -> {where} (router key {key})")
            return Assignment(sha, where, key)
        note(f"{sha[:12]}: the router put key {key} on {where}, which is full; re-keyed")
    note(f"{sha[:12]}: no key landed on a worker with room in {MAX_REKEY} tries")
    return None


def _standing(result: WarmResult, touched_after: int) -> tuple[bool, str]:
    proof = result.judgement
    if proof is None or proof.verdict != result.verdict:  # the build changed under it
        proof = judge_unproven(result.reason)
    return judge_resident(proof, touched_after)


def _prove(
    pool: Pool, placed: dict[str, Assignment], report: PoolReport, say: Say, *, warm_missing: bool
) -> None:
    """Per worker, rounds of fresh-tail checks of its heads (`warm_missing`: see the module)."""
    proofs: dict[str, Proof] = {}
    for url in dict.fromkeys(a.worker for a in placed.values()):
        # One fixed order (by sha) in every run, warm's or doctor's: after a run the first of
        # them is the least recently used, so the next run checks them oldest first and no
        # head waits behind more than the k-1 calls the capacity rule counts (`spec`).
        worker, mine = pool.workers[url], sorted(s for s, a in placed.items() if a.worker == url)
        last: dict[str, tuple[WarmResult, int]] = {}
        prefills = 0  # calls on this worker that may have evicted something
        for _round in range(PROOF_ROUNDS if warm_missing else 1):
            before = prefills
            for sha in mine:
                try:
                    result = warm(pool.registry, pool.heads[sha], worker, send_warm=False)
                except WorkerError as exc:
                    report.notes.append(f"{sha[:12]} on {url}: {exc}")
                    last.pop(sha, None)
                    prefills += 1  # it may have run on the server all the same
                    continue
                last[sha] = (result, prefills)
                if result.verdict != "resumed":  # a check that missed prefilled its head:
                    prefills += 1  # a warm, which may evict a head proven before it
                    if warm_missing:
                        say(f"{sha[:12]} was not resident on {url}: warmed by its check")
            if prefills == before:
                break
        for sha, (result, at) in last.items():
            resident, why = _standing(result, prefills - at)
            cached = None if result.check is None else result.check.evidence.cached_tokens
            key, build_id = placed[sha].key, result.build.build_id
            proofs[sha] = Proof(
                sha, url, key, result.verdict, resident, why, cached, result.span_tokens, build_id
            )
            placed[sha] = Assignment(sha, url, key, build_id)
    report.proofs = [proofs[s] for s in placed if s in proofs]


def doctor_pool(pool: Pool, *, prove: bool = True) -> PoolReport:
    """Each worker's build, size and capacity, and (with `prove`) one fresh-tail check of
    every head the kept placement puts on it. Flags builds that differ."""
    _check(pool)
    warnings = list(pool.warnings)
    report = PoolReport(pool.survey(), pool.spec.router, warnings=warnings, verb="doctor")
    note = report.notes.append
    if report.builds_differ:
        ids = sorted({w.build_id for w in report.workers if w.build_id})
        note(f"workers run different builds ({', '.join(ids)})")
    for state in report.workers:
        mine = [a for a in pool.placement.values() if a.worker == state.url]
        stale = [a.sha256[:12] for a in mine if a.build_id not in (None, state.build_id)]
        if stale and state.build_id is not None:
            text = f"{state.url} now runs build {state.build_id}; proven on another build: "
            note(text + ", ".join(stale))
        if len(mine) > state.capacity:
            note(f"{state.url} holds {len(mine)} heads but keeps {state.capacity}: overloaded")
    if not pool.placement:  # residency is proven per placed head: say there is none
        text = f"no head is placed on this pool (no placement at {pool.placement_path}): "
        text += "`pool warm REF...` with the same workers places them (a pool file and "
        report.warnings.append(text + "--worker lists each keep their own placement)")
    if prove:
        live = {s: a for s, a in pool.placement.items() if a.worker in pool.workers}
        try:
            _prove(pool, live, report, lambda _m: None, warm_missing=False)
        except PrefixregError as exc:
            report.notes.append(str(exc))
    return report


def status_pool(pool: Pool) -> PoolReport:
    """`doctor_pool` without a check (no chat call sent), judged by `status`'s rule: every
    worker answered."""
    report = doctor_pool(pool, prove=False)
    report.verb = "status"
    return report

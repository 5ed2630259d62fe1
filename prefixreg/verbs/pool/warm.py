"""`pool warm` and `pool doctor`: put registered prefixes on a pool and prove each one, per
worker, with a fresh-tail check on the worker that holds it.

`warm_pool`:
1. survey the workers (build, size, measured survival, capacity) and plan (`place`): the
   prefixes already placed keep their worker while it has room; what fits nowhere is
   refused before anything is sent (never evicting a resident prefix to make room);
2. without a router, warm each prefix directly on its planned worker;
3. with a router, send each new prefix's first call through the router with its routing
   key (`x-smg-routing-key`: the sha) and trace which worker served it (`served_marks`;
   the router hides its workers). A key that lands on a worker already at capacity is
   re-keyed (`<sha>.1`, ...; at most `MAX_REKEY` tries) and reported as such;
4. prove: every placed prefix gets a fresh-tail resume check *directly* on its worker
   (`warm_prefix`, so the measurement is bound to that worker's build); one that lost its
   slot (a misplaced first call can take it) is re-warmed there, and the round repeats, at
   most `PROOF_ROUNDS` times. Only proven prefixes stay in the kept placement.

`doctor_pool` re-proves the kept placement (a fresh-tail check per placed prefix, on its
worker: cheap, and it takes no other prefix's slot) and flags builds that differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from prefixreg.core.errors import PrefixregError, WorkerError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.prefix import fresh_tail
from prefixreg.verbs.measure.calls import WARM_PARAMS
from prefixreg.verbs.measure.warm import warm
from prefixreg.verbs.pool.live import Pool, WorkerState, served_by
from prefixreg.verbs.pool.spec import ROUTING_KEY_HEADER, Assignment, place, routing_key

__all__ = ["MAX_REKEY", "PROOF_ROUNDS", "PoolReport", "doctor_pool", "warm_pool"]

MAX_REKEY: Final = 8
PROOF_ROUNDS: Final = 3


@dataclass(slots=True)
class Proof:
    """One placed prefix's latest resume check on its worker."""

    sha256: str
    worker: str
    key: str
    verdict: str
    cached_tokens: int | None
    span_tokens: int | None
    build_id: str

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "worker": self.worker,
            "key": self.key,
            "verdict": self.verdict,
            "cached_tokens": self.cached_tokens,
            "span_tokens": self.span_tokens,
            "build_id": self.build_id,
        }


@dataclass(slots=True)
class PoolReport:
    """What `warm_pool` / `doctor_pool` found, per worker and per prefix."""

    workers: list[WorkerState]
    router: str | None
    proofs: list[Proof] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    asked: list[str] = field(default_factory=list)  # shas `warm_pool` was asked to place

    @property
    def builds_differ(self) -> bool:
        return len({w.build_id for w in self.workers if w.build_id is not None}) > 1

    @property
    def ok(self) -> bool:
        """Every prefix asked for is placed and proven resumed, and every worker answered.

        A prefix asked for with no proof at all (the router's placement could not be traced,
        re-keying ran out, its check failed) is not proven: never ok by omission.
        """
        proven = all(p.verdict == "resumed" for p in self.proofs)
        resumed = {p.sha256 for p in self.proofs if p.verdict == "resumed"}
        every_asked = all(sha in resumed for sha in self.asked)
        answered = all(w.error is None for w in self.workers)
        return proven and every_asked and not self.refused and answered

    @property
    def unverified(self) -> bool:
        """Not ok only because a check's counts were unverified (exit 4, not 1)."""
        bad = [p for p in self.proofs if p.verdict != "resumed"]
        return bool(bad) and all(p.verdict == "unverified" for p in bad)

    def held_by(self, url: str) -> list[Proof]:
        return [p for p in self.proofs if p.worker == url]

    def to_dict(self) -> JSONObject:
        return {
            "ok": self.ok,
            "router": self.router,
            "builds_differ": self.builds_differ,
            "capacity": sum(w.capacity for w in self.workers),
            "workers": [
                {**w.to_dict(), "holds": [p.to_dict() for p in self.held_by(w.url)]}
                for w in self.workers
            ],
            "refused": list(self.refused),
            "notes": list(self.notes),
        }


def _attempt_of(key: str) -> int:
    _, dot, n = key.partition(".")
    return int(n) if dot and n.isdigit() else 0


def warm_pool(
    pool: Pool, refs: Sequence[str], *, progress: Callable[[str], None] | None = None
) -> PoolReport:
    """Place `refs` on the pool within capacity, warm them, prove each on its worker."""
    say = progress or (lambda _msg: None)
    pool.registry.refuse_on_mirror("record measurements")
    asked = list(dict.fromkeys(pool.registry.get(r).sha256 for r in refs))  # verified bytes
    states = pool.survey()
    report = PoolReport(workers=states, router=pool.spec.router, asked=asked)
    capacity = {w.url: w.capacity for w in states if w.error is None}
    kept = [sha for sha in pool.placement if sha not in asked]
    current = {sha: a.worker for sha, a in pool.placement.items()}
    plan = place([*kept, *asked], capacity, current)
    for sha in plan.refused:
        total = sum(capacity.values())
        report.refused.append(sha)
        report.notes.append(
            f"{sha[:12]} refused: the pool keeps {total} prefixes and they are taken "
            "(nothing was sent; add a worker or drop a prefix)"
        )
    load: dict[str, int] = dict.fromkeys(capacity, 0)
    placed: dict[str, Assignment] = {}
    for sha, url in plan.assigned.items():
        old = pool.placement.get(sha)
        if old is not None and old.worker == url:
            placed[sha] = old
            load[url] += 1
    for sha, url in plan.assigned.items():
        if sha in placed:
            continue
        if pool.router is None:
            placed[sha] = Assignment(sha, url, routing_key(sha))
            load[url] += 1
            continue
        old = pool.placement.get(sha)
        start = 0 if old is None else _attempt_of(old.key) + 1
        got = _route_first_call(pool, sha, start, capacity, load, report, say)
        if got is not None:
            placed[sha] = got
            load[got.worker] += 1
    _prove(pool, placed, report, say, warm_missing=True)
    pool.placement = {p.sha256: placed[p.sha256] for p in report.proofs if p.verdict == "resumed"}
    pool.save()
    return report


def _route_first_call(
    pool: Pool,
    sha: str,
    start: int,
    capacity: dict[str, int],
    load: dict[str, int],
    report: PoolReport,
    say: Callable[[str], None],
) -> Assignment | None:
    """Send `sha`'s first call through the router; keep the key if it landed with room."""
    assert pool.router is not None  # noqa: S101 -- only called with a router
    prefix = pool.registry.get(sha)
    for attempt in range(start, start + MAX_REKEY):
        key = routing_key(sha, attempt)
        before = pool.served_marks()
        pool.router.chat(prefix, fresh_tail(), headers={ROUTING_KEY_HEADER: key}, **WARM_PARAMS)
        where = served_by(before, pool.served_marks())
        if where is None:
            report.notes.append(
                f"{sha[:12]}: cannot tell which worker served key {key} (no /slots or "
                "/cache, or other traffic); not placed"
            )
            return None
        if load.get(where, 0) < capacity.get(where, 0):
            say(f"{sha[:12]} -> {where} (router key {key})")
            return Assignment(sha, where, key)
        report.notes.append(
            f"{sha[:12]}: the router put key {key} on {where}, which is full; re-keyed"
        )
    report.notes.append(f"{sha[:12]}: no key landed on a worker with room in {MAX_REKEY} tries")
    return None


def _prove(
    pool: Pool,
    placed: dict[str, Assignment],
    report: PoolReport,
    say: Callable[[str], None],
    *,
    warm_missing: bool,
) -> None:
    """A fresh-tail check on each prefix's worker; re-warm what lost its slot, re-check."""
    proofs: dict[str, Proof] = {}
    for _round in range(PROOF_ROUNDS if warm_missing else 1):
        rewarmed = False
        for sha, a in list(placed.items()):
            worker = pool.workers[a.worker]
            try:
                head = pool.registry.head(sha)
                result = warm(pool.registry, head, worker, send_warm=False)
                if result.verdict != "resumed" and warm_missing:
                    say(f"{sha[:12]} not resident on {a.worker}: warming it there")
                    result = warm(pool.registry, head, worker)
                    rewarmed = True
            except WorkerError as exc:
                report.notes.append(f"{sha[:12]} on {a.worker}: {exc}")
                proofs.pop(sha, None)
                continue
            check = result.check
            proofs[sha] = Proof(
                sha256=sha,
                worker=a.worker,
                key=a.key,
                verdict=result.verdict,
                cached_tokens=None if check is None else check.evidence.cached_tokens,
                span_tokens=result.span_tokens,
                build_id=result.build.build_id,
            )
            placed[sha] = Assignment(sha, a.worker, a.key, result.build.build_id)
        # A re-warm may take the slot of a prefix checked earlier in the round: a round
        # that re-warmed nothing is the one whose checks all still stand.
        if not rewarmed:
            break
    report.proofs = [proofs[s] for s in placed if s in proofs]


def doctor_pool(pool: Pool, *, prove: bool = True) -> PoolReport:
    """Each worker's build, size and capacity, and (with `prove`) a fresh-tail check of
    every prefix the kept placement puts on it. Flags builds that differ."""
    report = PoolReport(workers=pool.survey(), router=pool.spec.router)
    if report.builds_differ:
        ids = sorted({w.build_id for w in report.workers if w.build_id})
        report.notes.append(f"workers run different builds ({', '.join(ids)})")
    for state in report.workers:
        mine = [a for a in pool.placement.values() if a.worker == state.url]
        stale = [a.sha256[:12] for a in mine if a.build_id not in (None, state.build_id)]
        if stale and state.build_id is not None:
            report.notes.append(
                f"{state.url} now runs build {state.build_id}; proven on another build: "
                + ", ".join(stale)
            )
        held = len(mine)
        if held > state.capacity:
            report.notes.append(
                f"{state.url} holds {held} prefixes but keeps {state.capacity}: overloaded"
            )
    live = {s: a for s, a in pool.placement.items() if a.worker in pool.workers}
    if prove:
        try:
            _prove(pool, dict(live), report, lambda _m: None, warm_missing=False)
        except PrefixregError as exc:
            report.notes.append(str(exc))
    return report

"""`keepalive`: keep prefixes resumable on a worker whose small LRU foreign traffic churns.

On a server with `/cache` (Halogen) it counts `stores` since each prefix was last used and
re-warms the prefix before one more foreign prompt could evict it. The budget (stores a
just-used prefix survives) comes, in order, from `--budget`, from the latest
`probe --survival` receipt for the same server build, or from `/cache` `max_entries` less
the entries one request stores. Servers without `/cache` are kept warm on a time interval.

Invariants:
- One request at a time: polls and re-warms run in one thread (`step`); the loop's `touch`
  only marks a prefix as just used, and the next poll takes the baseline.
- Every re-warm is a measured call; with a registry it is written as a `keepalive`
  measurement. A re-warm that comes back cold or partial proves the budget too large, and
  the budget tightens to what was observed.
- A poll the server is too busy to answer is skipped; a 503 on a re-warm backs off
  exponentially; repeated errors stop the keeper (`error` says why).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from prefixreg.errors import EngineBusyError, PrefixregError, WorkerError, WorkerTimeoutError
from prefixreg.jsonio import JSONObject, loads_object
from prefixreg.prefix import Prefix, fresh_tail
from prefixreg.records import CacheCounters, Measurement, ServerBuild, strict_count
from prefixreg.store import Registry, iso_utc, utc_now
from prefixreg.warm import CallRecord, Verdict, judge_resume, measured_call
from prefixreg.worker import Worker

__all__ = ["Budget", "KeepAlive", "KeepAliveSummary", "Rewarm", "budget_for"]

DEFAULT_PER_REQUEST: Final = 2
DEFAULT_INTERVAL_S: Final = 60.0
MAX_ERRORS: Final = 5
MAX_BACKOFF_S: Final = 30.0


@dataclass(slots=True)
class Budget:
    """How long a just-used prefix survives: `stores` on the server's counter, or seconds."""

    stores: int | None
    per_request: int
    interval_s: float | None
    source: str

    def due(self, since: int) -> bool:
        """Re-warm now: one more foreign prompt could take the prefix past the budget."""
        return self.stores is not None and since + self.per_request >= self.stores

    def to_dict(self) -> JSONObject:
        return {
            "stores": self.stores,
            "per_request": self.per_request,
            "interval_s": self.interval_s,
            "source": self.source,
        }


def _latest_survival(registry: Registry, build: ServerBuild) -> tuple[int, int | None, str] | None:
    """(survival, stores per prompt, probe run id) from the newest matching probe receipt."""
    directory = registry.root / "probes"
    if not directory.is_dir():
        return None
    for path in sorted(directory.glob("*.json"), reverse=True):
        try:
            receipt = loads_object(path.read_bytes(), path=path)
        except (OSError, PrefixregError):
            continue  # an unreadable receipt is not a budget; the next one may be
        rb = receipt.get("build")
        survival = strict_count(receipt.get("survival"))
        if not isinstance(rb, dict) or rb.get("build_id") != build.build_id or survival is None:
            continue
        run = receipt.get("run_id")
        return survival, strict_count(receipt.get("stores_per_prompt")), str(run)
    return None


def budget_for(
    build: ServerBuild,
    counters: CacheCounters | None,
    *,
    registry: Registry | None = None,
    budget: int | None = None,
    interval_s: float | None = None,
) -> Budget:
    """Choose the budget: explicit, else a probe's survival, else `max_entries`, else time."""
    per = DEFAULT_PER_REQUEST
    if counters is None:
        return Budget(None, per, interval_s or DEFAULT_INTERVAL_S, "time interval (no /cache)")
    if budget is not None:
        return Budget(budget, per, interval_s, "--budget")
    found = _latest_survival(registry, build) if registry is not None else None
    if found is not None:
        survival, stores_per_prompt, run = found
        per = stores_per_prompt or per
        return Budget(survival * per, per, interval_s, f"probe {run} (survival {survival})")
    if counters.max_entries is not None:
        return Budget(
            max(per, counters.max_entries - per),
            per,
            interval_s,
            f"max_entries {counters.max_entries} less {per} entries per request",
        )
    return Budget(None, per, interval_s or DEFAULT_INTERVAL_S, "time interval (no max_entries)")


@dataclass(frozen=True, slots=True)
class Rewarm:
    """One re-warm: which prefix, how many stores since its last use, what the server said."""

    sha256: str
    since: int | None
    verdict: Verdict
    record: CallRecord
    budget: int | None

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            "since_stores": self.since,
            "verdict": self.verdict,
            "budget_stores": self.budget,
            **self.record.to_dict(),
        }


@dataclass(slots=True)
class KeepAliveSummary:
    """What a keeper did: re-warms by outcome, tokens spent and kept warm, polls, errors."""

    rewarms: int = 0
    resumed: int = 0
    cold: int = 0
    unverified: int = 0
    tokens_spent: int = 0
    tokens_saved: int = 0
    polls: int = 0
    skipped_polls: int = 0
    errors: int = 0
    budget_changes: list[str] = field(default_factory=list)
    stopped_because: str | None = None

    def to_dict(self) -> JSONObject:
        return {
            "rewarms": self.rewarms,
            "resumed": self.resumed,
            "cold": self.cold,
            "unverified": self.unverified,
            "tokens_spent": self.tokens_spent,
            "tokens_saved": self.tokens_saved,
            "polls": self.polls,
            "skipped_polls": self.skipped_polls,
            "errors": self.errors,
            "budget_changes": list(self.budget_changes),
            "stopped_because": self.stopped_because,
        }

    def __str__(self) -> str:
        return (
            f"{self.rewarms} re-warms ({self.resumed} resumed, {self.cold} cold, "
            f"{self.unverified} unverified); {self.tokens_spent:,} tokens spent, "
            f"{self.tokens_saved:,} prefix tokens kept warm; {self.polls} polls "
            f"({self.skipped_polls} skipped), {self.errors} errors"
        )


@dataclass(slots=True)
class _Kept:
    prefix: Prefix
    baseline: int | None = None
    last_used: float = 0.0


class KeepAlive:
    """Keep `prefixes` resumable on `worker`. Run `step()` yourself, or `start()` a thread.

    The worker should have a short `timeout` (polls must not hang); `touch(sha)` after the
    loop's own call resets that prefix's count. `registry` (optional) receives one
    measurement per re-warm and supplies a probe's survival as the budget.
    """

    def __init__(
        self,
        worker: Worker,
        prefixes: Sequence[Prefix],
        *,
        registry: Registry | None = None,
        budget: int | None = None,
        interval_s: float | None = None,
        poll_s: float = 0.5,
        on_rewarm: Callable[[Rewarm], None] | None = None,
    ) -> None:
        self.worker = worker
        self.registry = registry
        self.poll_s = poll_s
        self.on_rewarm = on_rewarm
        self.summary = KeepAliveSummary()
        self.history: list[Rewarm] = []
        self._kept = {p.sha256: _Kept(p) for p in prefixes}
        self._touched: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors_in_row = 0
        self._backoff_until = 0.0
        self._last_stores: int | None = None
        self.build = worker.server_build()
        self.has_cache = self.build.profile == "halogen"
        counters = worker.cache() if self.has_cache else None
        self.has_cache = counters is not None
        self.budget = budget_for(
            self.build, counters, registry=registry, budget=budget, interval_s=interval_s
        )

    # -- the loop's side -----------------------------------------------------------------

    def touch(self, sha256: str) -> None:
        """The loop just used this prefix: count its survival from now on."""
        with self._lock:
            if sha256 in self._kept:
                self._touched.add(sha256)
                self._kept[sha256].last_used = time.monotonic()
        self._wake.set()

    # -- one round -----------------------------------------------------------------------

    def _poll(self) -> CacheCounters | None:
        self.summary.polls += 1
        try:
            counters = self.worker.cache()
        except (WorkerTimeoutError, EngineBusyError):
            self.summary.skipped_polls += 1  # too busy to answer: try again next round
            return None
        if counters is None or counters.stores is None:
            self.summary.skipped_polls += 1
            return None
        return counters

    def _due(self, counters: CacheCounters | None, now: float) -> list[tuple[_Kept, int | None]]:
        with self._lock:
            touched, self._touched = self._touched, set()
        if counters is None or counters.stores is None:
            interval = self.budget.interval_s or DEFAULT_INTERVAL_S
            return [(k, None) for k in self._kept.values() if now - k.last_used >= interval]
        stores = counters.stores
        if self._last_stores is not None and stores < self._last_stores:
            for kept in self._kept.values():  # the server restarted: nothing is cached
                kept.baseline = None
        self._last_stores = stores
        due: list[tuple[_Kept, int | None]] = []
        for sha, kept in self._kept.items():
            if sha in touched:
                kept.baseline = stores
            if kept.baseline is None:
                due.append((kept, None))
            elif self.budget.due(stores - kept.baseline):
                due.append((kept, stores - kept.baseline))
        return due

    def step(self) -> list[Rewarm]:
        """Poll once and re-warm every prefix that is due. Returns the re-warms made."""
        now = time.monotonic()
        if now < self._backoff_until:
            return []
        counters = self._poll() if self.has_cache else None
        if self.has_cache and counters is None:
            return []
        done = []
        for kept, since in self._due(counters, now):
            try:
                rewarm = self._rewarm(kept, since, counters)
            except EngineBusyError:
                self._error(backoff=True)
                break
            except WorkerError:
                self._error(backoff=False)
                break
            self._errors_in_row = 0
            done.append(rewarm)
            counters = rewarm.record.after if self.has_cache else None
        return done

    def _error(self, *, backoff: bool) -> None:
        self.summary.errors += 1
        self._errors_in_row += 1
        if backoff:
            delay = min(MAX_BACKOFF_S, self.poll_s * 2**self._errors_in_row)
            self._backoff_until = time.monotonic() + delay
        if self._errors_in_row >= MAX_ERRORS:
            self.summary.stopped_because = f"{self._errors_in_row} worker errors in a row"
            self._stop.set()

    def _rewarm(self, kept: _Kept, since: int | None, before: CacheCounters | None) -> Rewarm:
        tail = fresh_tail()
        record = measured_call(
            self.worker,
            kept.prefix,
            phase="keepalive",
            tail=tail,
            with_cache=self.has_cache,
            before=before,
        )
        verdict, _, _, _ = judge_resume(
            record.evidence,
            prefix_bytes=kept.prefix.size,
            tail_bytes=len(tail.encode("utf-8")),
            alignment=0,
        )
        kept.last_used = time.monotonic()
        after = record.after
        kept.baseline = after.stores if after is not None else None
        self._learn(record, verdict, since)
        rewarm = Rewarm(kept.prefix.sha256, since, verdict, record, self.budget.stores)
        self._count(rewarm)
        self._record(rewarm)
        if self.on_rewarm is not None:
            self.on_rewarm(rewarm)
        self.history.append(rewarm)
        return rewarm

    def _learn(self, record: CallRecord, verdict: Verdict, since: int | None) -> None:
        """Update stores-per-request from our own window; tighten the budget after a miss."""
        stored = None
        if record.before is not None and record.after is not None and not record.interleaved:
            b, a = record.before.stores, record.after.stores
            stored = None if a is None or b is None else a - b
        if stored is not None and stored > 0:
            self.budget.per_request = stored
        if since is None or verdict not in ("cold", "partial") or self.budget.stores is None:
            return
        # Evicted after `since` stores: the prefix survives fewer than that, by an unknown
        # amount. Halve (a few misses converge from any overestimate; a resumed re-warm is
        # cheap, a cold one costs a full prefill).
        tighter = max(self.budget.per_request, since // 2)
        if tighter < self.budget.stores:
            self.summary.budget_changes.append(
                f"budget {self.budget.stores} -> {tighter} stores: a re-warm after {since} "
                "stores came back cold"
            )
            self.budget.stores = tighter
            self.budget.source = "tightened after a cold re-warm"

    def _count(self, rewarm: Rewarm) -> None:
        s = self.summary
        ev = rewarm.record.evidence
        s.rewarms += 1
        if ev.cache_state == "unverified":
            s.unverified += 1
        elif rewarm.verdict == "resumed":
            s.resumed += 1
            s.tokens_saved += ev.cached_tokens or 0
        else:
            s.cold += 1
        if ev.prompt_tokens is not None:
            s.tokens_spent += ev.prompt_tokens - (ev.cached_tokens or 0)
        s.tokens_spent += ev.completion_tokens or 0

    def _record(self, rewarm: Rewarm) -> None:
        if self.registry is None:
            return
        ev = rewarm.record.evidence
        body: JSONObject = {
            "verdict": rewarm.verdict,
            "since_stores": rewarm.since,
            "budget": self.budget.to_dict(),
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "calls": [rewarm.record.to_dict()],
        }
        self.registry.write_measurement(
            Measurement(
                sha256=rewarm.sha256,
                at=iso_utc(utc_now()),
                kind="keepalive",
                build=self.build,
                body=body,
                worker=self.worker.url,
                model=self.worker.model,
            )
        )

    # -- running -------------------------------------------------------------------------

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s`, or too many errors."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set():
            self.step()
            if end is not None and time.monotonic() >= end:
                break
            wait = (
                self.poll_s if end is None else min(self.poll_s, max(0.0, end - time.monotonic()))
            )
            self._wake.wait(wait)
            self._wake.clear()
        return self.summary

    def start(self) -> KeepAlive:
        """Run in a daemon thread (the loop keeps its own thread)."""
        self._thread = threading.Thread(target=self.run, name="prefixreg-keepalive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> KeepAliveSummary:
        """Stop the thread (if any) and return the summary."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        return self.summary

    def __enter__(self) -> KeepAlive:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

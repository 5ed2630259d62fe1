"""`keepalive`: keep prefixes resumable on a worker whose small LRU foreign traffic churns.

On a server with `/cache` (Halogen) it counts `stores` since each prefix was last used and
re-warms the prefix before one more foreign prompt could evict it. The budget (stores a
just-used prefix survives) comes, in order, from `--budget`, from the latest
`probe --survival` receipt for the same server build, or from `/cache` `max_entries` less
the entries one request stores.

On llama.cpp (no `/cache`) it counts *prompts* since each prefix was last used, from the
activity counters the server offers (`/slots`, else `/metrics`; see `prefixreg.server.activity`).
That budget is in prompts: `--budget`, else the latest `probe --survival` for the same build
(survival is counted in prompts), else 1, that is a re-warm after every foreign prompt.
Why 1 and not `total_slots - 1` (what plain LRU over the slots would give): slot choice
also follows prompt similarity, a unified KV buffer (`-kvu`) lets a long prompt crowd
others out, and a re-warm costs only the fresh tail (~25 tokens, ~0.2 s) while a miss costs
the whole prefill; the probe measures the real number. Servers with neither counter (and
other profiles without `/cache`) are kept warm on a time interval.

Invariants:
- One request at a time: polls and re-warms run in one thread (`step`); the loop's `touch`
  only marks a prefix as just used, and the next poll takes the baseline.
- Every re-warm is a measured call; with a registry it is written as a `keepalive`
  measurement. A re-warm that comes back cold or partial proves the budget too large, and
  the budget tightens to what was observed.
- A poll the server is too busy to answer is skipped, and the next one waits longer; a 503
  on a re-warm backs off exponentially; five worker errors with no answered poll between
  them stop the keeper, and so does anything else that goes wrong in its thread
  (`summary.stopped_because` says why, `alive` turns false).
- Only foreign activity counts: a prefix is never due before a foreign prompt has stored
  (or run), and the stores of the keeper's own re-warms are taken off the other kept
  prefixes' counts; instead, each one's stores budget is reduced by the entries the other
  kept prefixes hold in the same LRU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from prefixreg.core.errors import (
    EngineBusyError,
    PrefixregError,
    UsageError,
    WorkerError,
    WorkerTimeoutError,
)
from prefixreg.core.jsonio import JSONObject, loads_object
from prefixreg.core.prefix import Prefix, fresh_tail
from prefixreg.core.records import CacheCounters, ServerBuild, strict_count
from prefixreg.registry.store import Registry
from prefixreg.server.activity import Counter, PromptCounter, StoresCounter
from prefixreg.server.evidence import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores
from prefixreg.server.worker import Worker
from prefixreg.verbs.warm import (
    CallRecord,
    Verdict,
    judge_resume,
    measured_call,
    record_measurement,
)

__all__ = ["Budget", "KeepAlive", "KeepAliveSummary", "Rewarm", "budget_for"]

DEFAULT_PER_REQUEST: Final = MEASURED_ENTRIES_PER_REQUEST
DEFAULT_PROMPTS: Final = 1
DEFAULT_INTERVAL_S: Final = 60.0
MAX_ERRORS: Final = 5
MAX_BACKOFF_S: Final = 30.0


Unit = Literal["stores", "prompts", "seconds"]


@dataclass(slots=True)
class Budget:
    """How long a just-used prefix survives, in the unit its counter counts.

    `limit` is in `unit`: stores on Halogen's `/cache`, prompts on llama.cpp's `/slots` or
    `/metrics`, else seconds. `per_request` is what one request adds to the counter (the
    entries a prompt stores; 1 prompt). `counter` names the source of the count.
    """

    limit: float
    unit: Unit
    per_request: int
    source: str
    counter: str | None = None

    @property
    def stores(self) -> int | None:
        return int(self.limit) if self.unit == "stores" else None

    @property
    def prompts(self) -> int | None:
        return int(self.limit) if self.unit == "prompts" else None

    @property
    def interval_s(self) -> float | None:
        return self.limit if self.unit == "seconds" else None

    def due(self, since: float) -> bool:
        """Re-warm now.

        Seconds and prompts: once the prefix has seen `limit`, the next moment or prompt may
        evict it. Stores: once at least one foreign prompt has stored (nothing else can
        evict), re-warm one prompt *before* the budget is reached, a margin for the traffic
        that lands between a poll and the re-warm.
        """
        if self.unit != "stores":
            return since >= self.limit
        return since >= self.per_request and since + self.per_request >= self.limit

    def describe(self) -> str:
        """`6 stores (/cache)`, `1 prompts (/slots)` or `60 s`, for a person."""
        if self.unit == "seconds":
            return f"{self.limit:g} s"
        return f"{int(self.limit)} {self.unit} ({self.counter})"

    def to_dict(self) -> JSONObject:
        return {
            "limit": self.limit,
            "unit": self.unit,
            "per_request": self.per_request,
            "counter": self.counter,
            "source": self.source,
        }


def _latest_survival(registry: Registry, build: ServerBuild) -> tuple[int, int | None, str] | None:
    """(survival, stores per prompt, probe run id) from the newest matching probe receipt."""
    for path, raw in registry.probe_receipts():
        try:
            receipt = loads_object(raw, path=path)
        except PrefixregError:
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
    prompt_counter: str | None = None,
    kept: int = 1,
) -> Budget:
    """Choose the budget for `kept` prefixes kept at once.

    With `/cache`: stores, from `--budget`, else a probe's survival for this build, else
    `max_entries`; with a prompt counter (llama.cpp's `/slots` or `/metrics`): prompts,
    from `--budget`, else a probe's survival, else `DEFAULT_PROMPTS`; otherwise seconds.
    The other kept prefixes hold entries of the same LRU (and are kept young), so a stores
    budget shrinks by their entries.
    """
    if counters is None and prompt_counter is not None:
        return _prompt_budget(build, registry, budget, prompt_counter)
    seconds = interval_s or DEFAULT_INTERVAL_S
    if counters is None:
        return Budget(seconds, "seconds", 0, "time interval (no /cache)")
    per = DEFAULT_PER_REQUEST
    found = _latest_survival(registry, build) if registry is not None else None
    if budget is not None:
        limit, source = budget, "--budget"
    elif found is not None:
        survival, stores_per_prompt, run = found
        per = stores_per_prompt or per
        limit, source = survival * per, f"probe {run} (survival {survival})"
    elif counters.max_entries is not None:
        limit = lru_survival_stores(counters.max_entries, per)
        source = f"max_entries {counters.max_entries} less {per} entries per request"
    else:
        return Budget(seconds, "seconds", 0, "time interval (no max_entries)")
    if kept > 1:
        limit -= (kept - 1) * per
        source += f", less {kept - 1} other kept prefixes"
    return Budget(max(per, limit), "stores", per, source, "/cache")


def _prompt_budget(
    build: ServerBuild, registry: Registry | None, budget: int | None, counter: str
) -> Budget:
    def made(prompts: int, source: str) -> Budget:
        return Budget(prompts, "prompts", 1, source, counter)

    if budget is not None:
        return made(budget, "--budget")
    found = _latest_survival(registry, build) if registry is not None else None
    if found is not None:
        survival, _, run = found
        source = f"probe {run} (survival {survival})"
        if survival == 0:
            # Nothing to wait for: re-warm after every prompt, and the re-warms will show
            # (cold) that this server keeps no prefix through a foreign prompt.
            source += ": the prefix survives no foreign prompt"
        return made(max(1, survival), source)
    return made(
        DEFAULT_PROMPTS, "default: a re-warm after every foreign prompt (no probe --survival)"
    )


@dataclass(frozen=True, slots=True)
class Rewarm:
    """One re-warm: which prefix, how much foreign activity since its last use (in the
    budget's unit; None for a first warm), and what the server said."""

    sha256: str
    since: float | None
    verdict: Verdict
    record: CallRecord
    budget: float
    unit: Unit

    def to_dict(self) -> JSONObject:
        return {
            "sha256": self.sha256,
            f"since_{self.unit}": self.since,
            "verdict": self.verdict,
            f"budget_{self.unit}": self.budget,
            **self.record.to_dict(),
        }


@dataclass(slots=True)
class KeepAliveSummary:
    """What a keeper did: re-warms by outcome, tokens spent and kept warm, polls, errors."""

    rewarms: int = 0
    resumed: int = 0
    partial: int = 0
    cold: int = 0
    unverified: int = 0
    tokens_spent: int = 0
    tokens_saved: int = 0
    polls: int = 0
    skipped_polls: int = 0
    errors: int = 0
    budget_changes: list[str] = field(default_factory=list)
    stopped_because: str | None = None
    stopped_by_worker: bool = False

    def to_dict(self) -> JSONObject:
        return {
            "rewarms": self.rewarms,
            "resumed": self.resumed,
            "partial": self.partial,
            "cold": self.cold,
            "unverified": self.unverified,
            "tokens_spent": self.tokens_spent,
            "tokens_saved": self.tokens_saved,
            "polls": self.polls,
            "skipped_polls": self.skipped_polls,
            "errors": self.errors,
            "budget_changes": list(self.budget_changes),
            "stopped_because": self.stopped_because,
            "stopped_by_worker": self.stopped_by_worker,
        }

    def __str__(self) -> str:
        return (
            f"{self.rewarms} re-warms ({self.resumed} resumed, {self.partial} partial, "
            f"{self.cold} cold, "
            f"{self.unverified} unverified); {self.tokens_spent:,} tokens spent, "
            f"{self.tokens_saved:,} prefix tokens kept warm; {self.polls} polls "
            f"({self.skipped_polls} skipped), {self.errors} errors"
        )


@dataclass(slots=True)
class _Kept:
    prefix: Prefix
    baseline: float | None = None  # the counter when last used; None: never warmed
    last_used: float = 0.0
    slot: int | None = None  # llama.cpp: the slot our last re-warm landed in


class KeepAlive:
    """Keep `prefixes` resumable on `worker`. Run `step()` yourself, or `start()` a thread.

    The worker should have a short `timeout` (polls must not hang); `touch(sha)` after the
    loop's own call resets that prefix's count. `registry` (optional) receives one
    measurement per re-warm and supplies a probe's survival as the budget. `alive` says
    whether the thread still runs; `summary.stopped_because` says why it stopped.
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
        if registry is not None:
            registry.refuse_on_mirror("record keepalive measurements")
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
        self._poll_misses = 0  # polls in a row the server was too busy to answer
        self._backoff_until = 0.0
        self.build = worker.server_build()
        counters = worker.cache() if self.build.profile == "halogen" else None
        self._counter: Counter | None = None
        if counters is not None and counters.stores is not None:
            self._counter = StoresCounter(worker)
            self._counter.saw(counters)
        elif self.build.profile == "llamacpp":
            # llama.cpp has no /cache but counts its tasks: time is only the last resort.
            self._counter = PromptCounter.detect(worker)
        self.budget = budget_for(
            self.build,
            counters,
            registry=registry,
            budget=budget,
            interval_s=interval_s,
            prompt_counter=None if self._counter is None else self._counter.source,
            kept=len(self._kept),
        )
        if self.budget.unit == "seconds":
            self._counter = None  # /cache without max_entries (dense): keep time instead

    # -- the loop's side -----------------------------------------------------------------

    def touch(self, sha256: str) -> None:
        """The loop just used this prefix: count its survival from now on."""
        with self._lock:
            if sha256 in self._kept:
                self._touched.add(sha256)
                self._kept[sha256].last_used = time.monotonic()
        self._wake.set()

    # -- one round -----------------------------------------------------------------------

    def _read(self, counter: Counter) -> float | None:
        """The counter now (None: skip this round); a restart forgets every baseline."""
        self.summary.polls += 1
        try:
            got = counter.read()
        except (WorkerTimeoutError, EngineBusyError):
            # Too busy to answer (a long prefill holds the queue): wait longer each time, so
            # abandoned polls cannot pile up behind it.
            self.summary.skipped_polls += 1
            self._poll_misses += 1
            self._backoff(self._poll_misses)
            return None
        except WorkerError:
            self.summary.skipped_polls += 1
            self._error(backoff=True)
            return None
        if got is None:
            self.summary.skipped_polls += 1
            return None
        self._errors_in_row = self._poll_misses = 0  # an answered poll ends both streaks
        total, restarted = got
        if restarted:
            for kept in self._kept.values():  # the server restarted: nothing is cached
                kept.baseline = None
        return total

    def _since(self, kept: _Kept, now: float) -> float | None:
        if self._counter is None:
            return now - kept.last_used
        return None if kept.baseline is None else self._counter.total - kept.baseline

    def _due(self, now: float) -> list[_Kept]:
        with self._lock:
            touched, self._touched = self._touched, set()
        due = []
        busy = self._counter.busy if self._counter is not None else set()
        for sha, kept in self._kept.items():
            if sha in touched and self._counter is not None:
                kept.baseline = self._counter.total
            if kept.slot is not None and kept.slot in busy:
                # Its slot is serving a prompt right now, most likely the loop's own call
                # on this prefix: a re-warm now would find the slot taken and prefill the
                # whole prefix cold in another one. Decide on the next poll.
                continue
            since = self._since(kept, now)
            if since is None or self.budget.due(since):
                due.append(kept)
        return due

    def step(self) -> list[Rewarm]:
        """Poll once and re-warm every prefix that is due. Returns the re-warms made."""
        now = time.monotonic()
        if now < self._backoff_until:
            return []
        if self._counter is not None and self._read(self._counter) is None:
            return []
        done = []
        for kept in self._due(now):
            try:
                rewarm = self._rewarm(kept, self._since(kept, time.monotonic()))
            except EngineBusyError:
                self._error(backoff=True)
                break
            except WorkerError:
                self._error(backoff=False)
                break
            self._errors_in_row = 0
            done.append(rewarm)
        return done

    def _backoff(self, n: int) -> None:
        delay = min(MAX_BACKOFF_S, self.poll_s * 2**n)
        self._backoff_until = time.monotonic() + delay

    def _error(self, *, backoff: bool) -> None:
        self.summary.errors += 1
        self._errors_in_row += 1
        if backoff:
            self._backoff(self._errors_in_row)
        if self._errors_in_row >= MAX_ERRORS:
            self.summary.stopped_because = f"{self._errors_in_row} worker errors in a row"
            self.summary.stopped_by_worker = True
            self._stop.set()

    def _rewarm(self, kept: _Kept, since: float | None) -> Rewarm:
        counter = self._counter
        stores = counter if isinstance(counter, StoresCounter) else None
        tail = fresh_tail()
        record = measured_call(
            self.worker,
            kept.prefix,
            phase="keepalive",
            tail=tail,
            with_cache=stores is not None,
            before=None if stores is None else stores.last,
        )
        verdict, _, _, _ = judge_resume(
            record.evidence,
            prefix_bytes=kept.prefix.size,
            tail_bytes=len(tail.encode("utf-8")),
            alignment=self.build.snapshot_align,
        )
        kept.last_used = time.monotonic()
        if counter is not None:
            self._rebase(kept, counter, record)
        self._learn(record, verdict, since)
        rewarm = Rewarm(
            kept.prefix.sha256, since, verdict, record, self.budget.limit, self.budget.unit
        )
        self._count(rewarm)
        self.history.append(rewarm)
        self._record(rewarm)
        if self.on_rewarm is not None:
            self.on_rewarm(rewarm)
        return rewarm

    def _rebase(self, kept: _Kept, counter: Counter, record: CallRecord) -> None:
        """After a re-warm: this prefix counts from now, and the counter units our own
        request added are not foreign activity for the other kept prefixes (their entries
        were already allowed for in the budget; counting them too would make the keeper
        re-warm its prefixes in turn forever)."""
        before = counter.total
        if isinstance(counter, StoresCounter):
            own = float(self.budget.per_request)
            after = record.after
            if after is not None and after.stores is not None:
                b = record.before
                if b is not None and b.stores is not None and not record.interleaved:
                    own = float(after.stores - b.stores)
                counter.saw(after)
                kept.baseline = counter.total
            else:
                # No closing snapshot: count from what was there plus our own stores, so
                # the next poll sees only what others stored since.
                kept.baseline = before + own
        else:
            own = 1.0
            # Our own prompt is the one change we expect; any other prompt that landed
            # during the re-warm is counted against the prefix (which of the two slots is
            # the least recently used is then unknown: assume the worse).
            kept.baseline = before + 1
            try:
                got = counter.read()
            except WorkerError:
                got = None  # the next poll sees our prompt and lands on since 0
            if got is not None:
                kept.baseline = min(got[0], before + 1)
                landed = counter.changed
                kept.slot = next(iter(landed)) if len(landed) == 1 else None
        for other in self._kept.values():
            if other is not kept and other.baseline is not None:
                other.baseline += own

    def _learn(self, record: CallRecord, verdict: Verdict, since: float | None) -> None:
        """Update stores-per-request from our own window; tighten the budget after a miss."""
        b = self.budget
        before = None if record.before is None else record.before.stores
        after = None if record.after is None else record.after.stores
        clean = b.unit == "stores" and not record.interleaved
        if clean and before is not None and after is not None and after > before:
            b.per_request = after - before
        if since is None or verdict not in ("cold", "partial"):
            return
        # Gone after `since` (a lower bound in prompts, exact in stores and seconds): it
        # survives less, by an unknown amount. Halve: a few misses converge from any
        # overestimate, and a resumed re-warm is cheap while a cold one is a full prefill.
        floor = b.per_request if b.unit == "stores" else (1 if b.unit == "prompts" else 0.0)
        tighter = max(floor, since // 2 if b.unit != "seconds" else since / 2)
        if tighter < b.limit:
            b.source = "tightened after a cold re-warm"
            self.summary.budget_changes.append(
                f"budget {b.limit:g} -> {tighter:g} {b.unit}: a re-warm after {since:g} "
                f"{b.unit} came back {verdict}"
            )
            b.limit = tighter

    def _count(self, rewarm: Rewarm) -> None:
        s = self.summary
        ev = rewarm.record.evidence
        s.rewarms += 1
        if ev.cache_state == "unverified":
            s.unverified += 1
        elif rewarm.verdict == "resumed":
            s.resumed += 1
            s.tokens_saved += ev.cached_tokens or 0
        elif rewarm.verdict == "partial":
            s.partial += 1
        else:
            s.cold += 1
        if ev.cache_state != "unverified" and ev.prompt_tokens is not None:
            # Verified counts only: a missing cached count is never taken as zero.
            s.tokens_spent += ev.prompt_tokens - (ev.cached_tokens or 0)
            s.tokens_spent += ev.completion_tokens or 0

    def _record(self, rewarm: Rewarm) -> None:
        if self.registry is None:
            return
        ev = rewarm.record.evidence
        body: JSONObject = {
            "verdict": rewarm.verdict,
            f"since_{rewarm.unit}": rewarm.since,
            "budget": self.budget.to_dict(),
            "prompt_tokens": ev.prompt_tokens,
            "cached_tokens": ev.cached_tokens,
            "calls": [rewarm.record.to_dict()],
        }
        record_measurement(self.registry, self.worker, self.build, rewarm.sha256, "keepalive", body)

    # -- running -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the keeper's thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s`, or too many errors."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 -- a keeper thread must never die mute
                # Not the worker's doing (a measurement that cannot be written, a failing
                # callback): stop and say why rather than let the thread die with a traceback.
                self.summary.stopped_because = f"{type(exc).__name__}: {exc}"
                self._stop.set()
                break
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
        if self._thread is not None:
            raise UsageError("this keeper is already running: one thread, one request at a time")
        self._thread = threading.Thread(target=self.run, name="prefixreg-keepalive", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> KeepAliveSummary:
        """Stop the thread (if any), waiting for a re-warm in flight, and return the summary."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self.worker.read_timeout + self.worker.timeout)
        return self.summary

    def __enter__(self) -> KeepAlive:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

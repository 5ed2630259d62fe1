"""`keepalive`: keep prefixes resumable on a worker whose small LRU foreign traffic churns.

On a server with `/cache` (Halogen) it counts `stores` since each prefix was last used and
re-warms the prefix before one more foreign prompt could evict it. The budget (stores a
just-used prefix survives) comes, in order, from `--budget`, from the latest
`probe --survival` receipt for the same server build, or from `/cache` `max_entries` less
the entries one request stores.

On llama.cpp (no `/cache`) it counts *prompts* since each prefix was last used, from the
activity counters the server offers:

- `/slots` (on by default): each slot's `id_task` changes exactly when the slot starts a
  completion. Every slot whose `id_task` moved between two polls is one prompt, counted
  once the slot is idle again (LRU goes by when a slot was last used). The raw
  `id_task` values are no count: one chat consumes three task ids and every `/slots` or
  `/metrics` read consumes more (measured), so `max(id_task)` deltas mostly count polls.
- `/metrics` (with `--metrics`), when `/slots` is off: a poll window in which
  `prompt_tokens_total + prompt_tokens_cached_total` moved is one prompt.

Both are lower bounds (two prompts on one slot, or two concurrent prompts under
`/metrics`, between polls count as one), exact when polls come faster than prompts finish,
which `poll_s` (0.5 s; a prompt takes at least ~0.1 s there) makes the usual case. The
budget is in prompts: `--budget`, else the latest `probe --survival` for the same build
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
from prefixreg.evidence import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores
from prefixreg.jsonio import JSONObject, loads_object
from prefixreg.prefix import Prefix, fresh_tail
from prefixreg.records import CacheCounters, ServerBuild, strict_count
from prefixreg.store import Registry
from prefixreg.warm import CallRecord, Verdict, judge_resume, measured_call, record_measurement
from prefixreg.worker import Worker

__all__ = ["Budget", "KeepAlive", "KeepAliveSummary", "Rewarm", "budget_for"]

DEFAULT_PER_REQUEST: Final = MEASURED_ENTRIES_PER_REQUEST
DEFAULT_PROMPTS: Final = 1
DEFAULT_INTERVAL_S: Final = 60.0
MAX_ERRORS: Final = 5
MAX_BACKOFF_S: Final = 30.0


@dataclass(slots=True)
class Budget:
    """How long a just-used prefix survives: `stores` on `/cache`, `prompts` (llama.cpp's
    activity counters), or seconds. `counter` names what `since` is read from."""

    stores: int | None
    per_request: int
    interval_s: float | None
    source: str
    prompts: int | None = None
    counter: str | None = None

    @property
    def unit(self) -> str:
        """What `since` counts: "stores", "prompts" or "seconds"."""
        if self.prompts is not None:
            return "prompts"
        return "stores" if self.stores is not None else "seconds"

    def due(self, since: int) -> bool:
        """Re-warm now.

        In prompts: the prefix survives `prompts` foreign prompts, so once it has seen that
        many the next one may evict it. In stores: re-warm one prompt *before* the budget is
        reached, a margin for the traffic that lands between a poll and the re-warm.
        """
        if self.prompts is not None:
            return since >= self.prompts
        return self.stores is not None and since + self.per_request >= self.stores

    def describe(self) -> str:
        """`6 stores`, `1 prompts (/slots)` or `60 s`, for a person."""
        if self.prompts is not None:
            return f"{self.prompts} prompts ({self.counter})"
        if self.stores is not None:
            return f"{self.stores} stores"
        return f"{self.interval_s or DEFAULT_INTERVAL_S:g} s"

    def to_dict(self) -> JSONObject:
        return {
            "stores": self.stores,
            "prompts": self.prompts,
            "per_request": self.per_request,
            "interval_s": self.interval_s,
            "unit": self.unit,
            "counter": self.counter,
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
    prompt_counter: str | None = None,
) -> Budget:
    """Choose the budget: explicit, else a probe's survival, else `max_entries`, else time.

    Without `/cache` but with a `prompt_counter` (llama.cpp's `/slots` or `/metrics`) the
    budget is in prompts: explicit, else a probe's survival, else `DEFAULT_PROMPTS`.
    """
    per = DEFAULT_PER_REQUEST
    if counters is None and prompt_counter is not None:
        return _prompt_budget(build, registry, budget, interval_s, prompt_counter)
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
            max(per, lru_survival_stores(counters.max_entries, per)),
            per,
            interval_s,
            f"max_entries {counters.max_entries} less {per} entries per request",
        )
    return Budget(None, per, interval_s or DEFAULT_INTERVAL_S, "time interval (no max_entries)")


def _prompt_budget(
    build: ServerBuild,
    registry: Registry | None,
    budget: int | None,
    interval_s: float | None,
    counter: str,
) -> Budget:
    def made(prompts: int, source: str) -> Budget:
        return Budget(None, 1, interval_s, source, prompts=prompts, counter=counter)

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
    """One re-warm: which prefix, how many stores (or prompts) since its last use, what the
    server said."""

    sha256: str
    since: int | None
    verdict: Verdict
    record: CallRecord
    budget: int | None
    unit: str = "stores"

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


class _PromptCounter:
    """Prompts the server has started, counted from llama.cpp's `/slots` or `/metrics`.

    `read()` returns the running count since the keeper started (None when the poll could
    not be made), and whether the server restarted since the last read (a slot's `id_task`
    or the cumulative prompt tokens went backwards: every prefix is gone).
    """

    def __init__(self, worker: Worker, source: str) -> None:
        self.worker = worker
        self.source = source
        self.total = 0
        self.busy: set[int] = set()  # slots processing at the last read
        self.changed: set[int] = set()  # slots counted at the last read
        self._slots: dict[int, int] | None = None
        self._tokens: int | None = None

    @classmethod
    def detect(cls, worker: Worker) -> _PromptCounter | None:
        """The best counter this server offers (`/slots`, else `/metrics`), or None."""
        for source in ("/slots", "/metrics"):
            counter = cls(worker, source)
            try:
                if counter.read() is not None:
                    return counter
            except WorkerError:
                continue  # a route that errors is a route we cannot count with
        return None

    def read(self) -> tuple[int, bool] | None:
        if self.source == "/slots":
            return self._read_slots()
        return self._read_metrics()

    def _read_slots(self) -> tuple[int, bool] | None:
        raw = self.worker.slots()
        if raw is None or not raw:
            return None
        last = self._slots
        now: dict[int, int] = {}
        self.busy = {
            sid
            for slot in raw
            if (sid := strict_count(slot.get("id"))) is not None
            if slot.get("is_processing") is True
        }
        for slot in raw:
            sid, task = strict_count(slot.get("id")), strict_count(slot.get("id_task"))
            if sid is None or task is None:
                continue
            if slot.get("is_processing") is True and last is not None and sid in last:
                # Count a prompt once its slot is done with it: llama.cpp picks the least
                # recently used slot by when it was last used, so a re-warm that finishes
                # before a foreign prompt does still leaves the prefix's slot the older
                # one. This also keeps the loop's own call in flight from counting before
                # its `touch` arrives.
                now[sid] = last[sid]
                continue
            now[sid] = task
        self._slots = now
        if last is None:
            return self.total, False
        if any(task < last[sid] for sid, task in now.items() if sid in last):
            return self.total, True
        # A slot that shows a task it did not show before served at least one prompt.
        self.changed = {sid for sid, task in now.items() if last.get(sid) != task}
        self.total += len(self.changed)
        return self.total, False

    def _read_metrics(self) -> tuple[int, bool] | None:
        samples = self.worker.metrics()
        if samples is None:
            return None
        done = samples.get("llamacpp:prompt_tokens_total")
        cached = samples.get("llamacpp:prompt_tokens_cached_total")
        if done is None or cached is None:
            return None
        tokens = int(done + cached)
        last, self._tokens = self._tokens, tokens
        if last is None:
            return self.total, False
        if tokens < last:
            return self.total, True
        self.total += 1 if tokens > last else 0
        return self.total, False


@dataclass(slots=True)
class _Kept:
    prefix: Prefix
    baseline: int | None = None
    last_used: float = 0.0
    slot: int | None = None  # llama.cpp: the slot our last re-warm landed in


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
        # llama.cpp has no /cache but counts its tasks: keep time only as the last resort.
        self._prompts = (
            _PromptCounter.detect(worker)
            if not self.has_cache and self.build.profile == "llamacpp"
            else None
        )
        self.budget = budget_for(
            self.build,
            counters,
            registry=registry,
            budget=budget,
            interval_s=interval_s,
            prompt_counter=None if self._prompts is None else self._prompts.source,
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
        except WorkerError:
            self.summary.skipped_polls += 1
            self._error(backoff=True)  # unreachable or a bad reply: count it, back off
            return None
        if counters is None or counters.stores is None:
            self.summary.skipped_polls += 1
            return None
        return counters

    def _poll_prompts(self, counter: _PromptCounter) -> int | None:
        """The prompt count now (None: skip this round), resetting baselines on a restart."""
        self.summary.polls += 1
        try:
            got = counter.read()
        except (WorkerTimeoutError, EngineBusyError):
            got = None  # too busy to answer (a long prefill holds the task queue): next round
        except WorkerError:
            got = None
            self._error(backoff=True)
        if got is None:
            self.summary.skipped_polls += 1
            return None
        total, restarted = got
        if restarted:
            for kept in self._kept.values():  # the server restarted: nothing is cached
                kept.baseline = None
        return total

    def _due_prompts(self, total: int) -> list[tuple[_Kept, int | None]]:
        with self._lock:
            touched, self._touched = self._touched, set()
        due: list[tuple[_Kept, int | None]] = []
        busy = self._prompts.busy if self._prompts is not None else set()
        for sha, kept in self._kept.items():
            if sha in touched:
                kept.baseline = total
            if kept.slot is not None and kept.slot in busy:
                # Its slot is serving a prompt right now, most likely the loop's own call
                # on this prefix: a re-warm now would find the slot taken and prefill the
                # whole prefix cold in another one. Decide on the next poll.
                continue
            if kept.baseline is None:
                due.append((kept, None))
            elif self.budget.due(total - kept.baseline):
                due.append((kept, total - kept.baseline))
        return due

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
        total = None
        if self._prompts is not None:
            total = self._poll_prompts(self._prompts)
            if total is None:
                return []
            due = self._due_prompts(total)
        else:
            due = self._due(counters, now)
        done = []
        for kept, since in due:
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
        prompts_before = None if self._prompts is None else self._prompts.total
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
            alignment=self.build.snapshot_align,
        )
        kept.last_used = time.monotonic()
        after = record.after
        kept.baseline = after.stores if after is not None else None
        if self._prompts is not None and prompts_before is not None:
            # Our own prompt is the one change we expect; any other prompt that landed
            # during the re-warm is counted against the prefix (which of the two slots is
            # the least recently used is then unknown: assume the worse).
            kept.baseline = prompts_before + 1
            try:
                got = self._prompts.read()
            except (WorkerTimeoutError, EngineBusyError):
                got = None  # the next poll sees our prompt and lands on since 0
            if got is not None:
                kept.baseline = min(got[0], prompts_before + 1)
                landed = self._prompts.changed
                kept.slot = next(iter(landed)) if len(landed) == 1 else None
            # A re-warm resumes its own slot, so it takes no other prefix's place: it is
            # not a foreign prompt for the other kept prefixes either (without this, two
            # kept prefixes on a budget of 1 would re-warm each other forever).
            for other in self._kept.values():
                if other is not kept and other.baseline is not None:
                    other.baseline += 1
        self._learn(record, verdict, since)
        limit = self.budget.prompts if self._prompts is not None else self.budget.stores
        unit = "prompts" if self._prompts is not None else "stores"
        rewarm = Rewarm(kept.prefix.sha256, since, verdict, record, limit, unit)
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
        if since is None or verdict not in ("cold", "partial"):
            return
        if self.budget.prompts is not None:
            # Evicted after `since` prompts (a lower bound on the prompts there were): it
            # survives fewer. Halve, as for stores; 1 is the floor (re-warm after each).
            fewer = max(1, since // 2)
            if fewer < self.budget.prompts:
                self.summary.budget_changes.append(
                    f"budget {self.budget.prompts} -> {fewer} prompts: a re-warm after "
                    f"{since} prompts came back {verdict}"
                )
                self.budget.prompts = fewer
                self.budget.source = "tightened after a cold re-warm"
            return
        if self.budget.stores is None:
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

    def run(self, duration_s: float | None = None) -> KeepAliveSummary:
        """Step every `poll_s` until `stop()`, `duration_s`, or too many errors."""
        end = None if duration_s is None else time.monotonic() + duration_s
        while not self._stop.is_set():
            try:
                self.step()
            except PrefixregError as exc:
                # Not the worker's doing (a measurement that cannot be written, say): stop
                # and say why rather than let a thread die with a traceback.
                self.summary.stopped_because = str(exc)
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

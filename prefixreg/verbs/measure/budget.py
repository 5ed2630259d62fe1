"""The keeper's budget: how much foreign activity a just-used head survives, in the unit the
server's counter offers: `stores` (Halogen `/cache`), `prompts` (llama.cpp `/slots` or
`/metrics`), else `seconds`. Its source, in order: `--budget`; the latest `probe --survival`
for the same build; `max_entries` less the entries one request stores, or 1 prompt; else a
time interval. On llama.cpp 1 prompt, not `total_slots - 1`: slot choice follows prompt
similarity, a unified KV buffer lets a long prompt crowd others out, and a re-warm costs
~25 tokens while a miss costs the whole prefill (`probe --survival` measures the truth).

Invariants:
- A probe receipt counts only for the exact build it measured, and only when its survival
  is a verified number (an unverified survival is never a budget).
- A stores budget never drops below what one request stores; the other kept heads'
  entries are taken off it, since they live in the same LRU.
- Pure policy: it reads receipts through the store's public API and writes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Final, Literal

from prefixreg.core.errors import PrefixregError
from prefixreg.core.jsonio import loads_object
from prefixreg.core.records import CacheCounters, ServerBuild, strict_count
from prefixreg.registry.store import Registry
from prefixreg.server.counters import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores

DEFAULT_INTERVAL_S: Final = 60.0

Unit = Literal["stores", "prompts", "seconds"]


@dataclass(slots=True)
class Budget:
    """How long a just-used head survives: `limit` in `unit`; `per_request` is what one
    request adds to the `counter` (the entries a prompt stores; 1 prompt)."""

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

    def due(self, since: float) -> bool:
        """Re-warm now? Seconds and prompts: once the head has seen `limit` (the next
        moment or prompt may evict it). Stores: once a foreign prompt has stored (nothing
        else can evict) and one more prompt could reach the budget, a margin for the
        traffic that lands between a poll and the re-warm."""
        if self.unit != "stores":
            return since >= self.limit
        return since >= self.per_request and since + self.per_request >= self.limit

    def learn(
        self,
        before: CacheCounters | None,
        after: CacheCounters | None,
        interleaved: bool | None,
        verdict: str,
        since: float | None,
    ) -> str | None:
        """After a re-warm (its `/cache` window, the judge's verdict, the activity `since`
        the head's last use): learn stores-per-request from a clean window, and tighten the
        limit after a miss. Returns the change, said for a person, or None."""
        b = None if before is None else before.stores
        a = None if after is None else after.stores
        if self.unit == "stores" and not interleaved and b is not None and a is not None and a > b:
            self.per_request = a - b
        if since is None or verdict not in ("cold", "partial"):
            return None
        # Gone after `since` (a lower bound in prompts, exact in stores and seconds): it
        # survives less, by an unknown amount. Halve: a few misses converge from any
        # overestimate, and a resumed re-warm is cheap while a cold one is a full prefill.
        unit = self.unit
        floor = self.per_request if unit == "stores" else (1 if unit == "prompts" else 0.0)
        tighter = max(floor, since // 2 if unit != "seconds" else since / 2)
        if tighter >= self.limit:
            return None
        change = f"budget {self.limit:g} -> {tighter:g} {unit}: a re-warm after {since:g} {unit} "
        change += f"came back {verdict}"
        self.source, self.limit = f"tightened after a {verdict} re-warm", tighter
        return change

    def describe(self) -> str:
        """`6 stores (/cache)`, `1 prompts (/slots)` or `60 s`, for a person."""
        if self.unit == "seconds":
            return f"{self.limit:g} s"
        return f"{int(self.limit)} {self.unit} ({self.counter})"

    to_dict = asdict


def latest_survival(registry: Registry, build: ServerBuild) -> tuple[int, int | None, str] | None:
    """(survival, stores per prompt, probe run id) from the newest receipt for `build`."""
    for path, raw in registry.probe_receipts():
        try:
            receipt = loads_object(raw, path=path)
        except PrefixregError:
            continue  # an unreadable receipt is not a budget; the next one may be
        rb, survival = receipt.get("build"), strict_count(receipt.get("survival"))
        if isinstance(rb, dict) and rb.get("build_id") == build.build_id and survival is not None:
            per = strict_count(receipt.get("stores_per_prompt"))
            return survival, per, str(receipt.get("run_id"))
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
    """The budget for `kept` heads kept at once (see the module docstring for the order)."""
    found = latest_survival(registry, build) if registry is not None and budget is None else None
    if counters is None and prompt_counter is not None:
        if budget is not None:
            return Budget(budget, "prompts", 1, "--budget", prompt_counter)
        if found is None:
            why = "default: a re-warm after every foreign prompt (no probe --survival)"
            return Budget(1, "prompts", 1, why, prompt_counter)
        survival, _, run = found
        # Survival 0: re-warm after every prompt; the (cold) re-warms will show it.
        none = ": the prefix survives no foreign prompt" if survival == 0 else ""
        source = f"probe {run} (survival {survival}){none}"
        return Budget(max(1, survival), "prompts", 1, source, prompt_counter)
    seconds = interval_s or DEFAULT_INTERVAL_S
    if counters is None:
        return Budget(seconds, "seconds", 0, "time interval (no /cache)")
    per = MEASURED_ENTRIES_PER_REQUEST
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
    if kept > 1:  # the other kept heads hold entries of the same LRU (and are kept young)
        limit -= (kept - 1) * per
        source += f", less {kept - 1} other kept prefixes"
    return Budget(max(per, limit), "stores", per, source, "/cache")

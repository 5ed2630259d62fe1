"""`doctor`: what a worker's own `/health` and `/cache` say about its prompt cache, and how far
its cache reaches against the registered prefixes.

`diagnose` is pure: it takes the two replies and returns findings in plain words, each quoting
the worker's fields and numbers, plus what to change. When the entries are fixed-size slabs
(Flash: ``last_entry_bytes`` is ``prompt_cache.cap_mb`` MiB whatever the prompt) a bigger or
longer-lived cache comes from the cache-size option, ``cacheMb`` (env ``HALOGEN_CACHE_MB``),
not from more entries (``HALOGEN_CACHE_ENTRIES``), and every piece of advice says so.

`diagnose_reach` is pure too: it compares Cmax, the largest cached count a fresh-tail call was
served in the latest probe receipt of this build, with the registered prefixes' token spans
(from their latest measurement on this build): does each one fit in what one entry resumes?
Below ``URGENT_CMAX`` tokens the design does not reach past the system prompt: that is urgent.

`doctor` reads the replies and, given a registry, its receipts and measurements. Nothing here
guesses a number the server did not send: a missing field is said to be missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import CacheCounters, strict_count
from prefixreg.registry.store import Registry
from prefixreg.server.counters import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores
from prefixreg.server.worker import Worker
from prefixreg.verbs.doctor.reach import PrefixSpan, ProbeReach, Reach, read_reach

__all__ = [
    "CACHE_SIZE_SETTING",
    "URGENT_CMAX",
    "Diagnosis",
    "Finding",
    "PrefixSpan",
    "ProbeReach",
    "diagnose",
    "diagnose_reach",
    "doctor",
]

MIB: Final = 1 << 20
URGENT_CMAX: Final = 4000
CACHE_SIZE_SETTING: Final = "the cache-size option `cacheMb` (env HALOGEN_CACHE_MB)"
ENTRIES_SETTING: Final = "HALOGEN_CACHE_ENTRIES"
# Halogen dense keeps ~64 KiB of KV per position (`slots x slot_ctx x 64 KiB` pool).
DENSE_BYTES_PER_POSITION: Final = 64 * 1024
THRASH_RATIO: Final = 0.9
THRASH_HIT_RATE: Final = 0.5

Level = Literal["ok", "info", "warn"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One observation: `warn` means something to change."""

    level: Level
    topic: str
    text: str

    def to_dict(self) -> JSONObject:
        return {"level": self.level, "topic": self.topic, "text": self.text}


@dataclass(slots=True)
class Diagnosis:
    """Everything doctor found, and the numbers it used."""

    profile: str
    findings: list[Finding] = field(default_factory=list)
    numbers: dict[str, JSONValue] = field(default_factory=dict)

    @property
    def healthy(self) -> bool:
        return not any(f.level == "warn" for f in self.findings)

    def add(self, level: Level, topic: str, text: str) -> None:
        self.findings.append(Finding(level, topic, text))

    def to_dict(self) -> JSONObject:
        return {
            "profile": self.profile,
            "healthy": self.healthy,
            "numbers": self.numbers,
            "findings": [f.to_dict() for f in self.findings],
        }


def slab_entries(c: CacheCounters, block: Mapping[str, JSONValue]) -> bool:
    """Are entries fixed slabs of `prompt_cache.cap_mb` MiB (Flash's measured shape)?"""
    cap = strict_count(block.get("cap_mb"))
    size = c.last_entry_bytes
    return cap is not None and cap > 0 and size is not None and size // MIB == cap


def _raise_setting(slab: bool) -> str:
    if slab:
        return f"raise {CACHE_SIZE_SETTING}, not {ENTRIES_SETTING} (entries are fixed slabs)"
    return f"raise {ENTRIES_SETTING}"


def _diagnose_counters(d: Diagnosis, c: CacheCounters, block: Mapping[str, JSONValue]) -> None:
    slab = slab_entries(c, block)
    d.numbers["slab_entries"] = slab
    if c.entries is not None and c.max_entries is not None:
        d.add("info", "entries", f"{c.entries} of max_entries {c.max_entries} entries in use.")
        per = MEASURED_ENTRIES_PER_REQUEST
        left = lru_survival_stores(c.max_entries, per) // per
        d.numbers["survival_estimate"] = left
        text = (
            f"With max_entries {c.max_entries} and {per} entries stored per prompt (system end "
            f"and history end), a prefix survives about {left} foreign prompts before it is "
            "evicted (`prefixreg probe --survival` measures it)."
        )
        if left <= 3:
            d.add(
                "warn",
                "survival",
                text + f" That is few for a loop that pauses: {_raise_setting(slab)}, "
                "or run `prefixreg keepalive`.",
            )
        else:
            d.add("info", "survival", text)
    elif c.entries is not None:
        d.add("info", "entries", f"{c.entries} entries in use; /cache reports no max_entries.")
    if c.last_entry_bytes is not None:
        size = c.last_entry_bytes / MIB
        cap = block.get("cap_mb")
        note = f" (/health prompt_cache.cap_mb is {cap})" if cap is not None else ""
        d.add(
            "info", "entry_size", f"last_entry_bytes {c.last_entry_bytes:,} = {size:.1f} MiB{note}."
        )
    if slab:
        d.add(
            "info",
            "slab",
            f"Entries are fixed slabs of {c.last_entry_bytes or 0:,} bytes (/health "
            f"prompt_cache.cap_mb {block.get('cap_mb')}), whatever the prompt size: more "
            f"entries ({ENTRIES_SETTING}) are more slabs of the same size. What one entry "
            f"holds, and the room for more, comes from {CACHE_SIZE_SETTING}.",
        )
    rate = None
    if c.hits is not None and c.misses is not None:
        total = c.hits + c.misses
        rate = None if total == 0 else c.hits / total
        d.numbers["hit_rate"] = None if rate is None else round(rate, 4)
        if rate is None:
            d.add("info", "hit_rate", "no lookups yet (hits 0, misses 0).")
        else:
            d.add("info", "hit_rate", f"hits {c.hits:,}, misses {c.misses:,}: hit rate {rate:.1%}.")
    if c.stores is not None and c.evicted is not None:
        d.numbers["evicted_per_store"] = None if c.stores == 0 else round(c.evicted / c.stores, 4)
        # Once an LRU is full every store evicts, so the ratio alone only says "full". It is
        # thrashing when entries are evicted that fast *and* lookups rarely find anything.
        churn = c.stores >= 10 and c.evicted >= THRASH_RATIO * c.stores
        if churn and rate is not None and rate < THRASH_HIT_RATE:
            d.add(
                "warn",
                "thrashing",
                f"stores {c.stores:,} against evicted {c.evicted:,} with a hit rate of "
                f"{rate:.1%}: nearly every store evicts an entry before it is reused, so "
                "prefixes rarely live long enough to be resumed. "
                + (
                    "R" + _raise_setting(slab)[1:]
                    if slab
                    else f"Raise {ENTRIES_SETTING} (or HALOGEN_CACHE_MB on dense)"
                )
                + ", cut foreign traffic, or run `prefixreg keepalive`.",
            )
        elif churn:
            d.add(
                "info",
                "thrashing",
                f"stores {c.stores:,}, evicted {c.evicted:,}: the cache is full and turns over, "
                "but lookups still hit.",
            )
        else:
            d.add("ok", "thrashing", f"stores {c.stores:,}, evicted {c.evicted:,}.")
    if c.refused:
        d.add(
            "warn",
            "refused",
            f"refused {c.refused:,}: stores the budget could not take. Raise {CACHE_SIZE_SETTING}.",
        )


def _diagnose_budget(
    d: Diagnosis, health: Mapping[str, JSONValue], raw: Mapping[str, object]
) -> None:
    """Dense: can the configured budget hold even one full-context entry?"""
    cap_bytes = strict_count(raw.get("cap_bytes"))
    slot_ctx = strict_count(health.get("slot_ctx")) or strict_count(health.get("context"))
    if cap_bytes is None or slot_ctx is None:
        return
    full = slot_ctx * DENSE_BYTES_PER_POSITION
    d.numbers["full_context_entry_bytes"] = full
    if cap_bytes < full:
        d.add(
            "warn",
            "budget",
            f"cap_bytes {cap_bytes:,} cannot hold one full-context entry (slot_ctx {slot_ctx:,} x "
            f"64 KiB = {full:,} bytes): the cache reports itself enabled and never hits. "
            "Raise HALOGEN_CACHE_MB (or leave it empty for auto).",
        )
    else:
        d.add(
            "ok",
            "budget",
            f"cap_bytes {cap_bytes:,} holds {cap_bytes // full} full-context entries.",
        )


def diagnose(
    profile: str, health: Mapping[str, JSONValue], cache_raw: Mapping[str, object] | None
) -> Diagnosis:
    """Read a worker's `/health` and `/cache` replies into findings (pure)."""
    d = Diagnosis(profile=profile)
    block = health.get("prompt_cache")
    block = block if isinstance(block, dict) else {}
    d.numbers["prompt_cache"] = dict(block) if block else None
    if profile != "halogen":
        can = {
            "llamacpp": "per-call cached_tokens (usage.prompt_tokens_details, with an explicit "
            "0 when cold, and timings.cache_n), build identity from /props; it cannot prove "
            "capacity, survival or eviction: llama.cpp has no cache-entry counters, so those "
            "are only measured with calls (`prefixreg probe`)",
            "vllm": "per-call cached_tokens only when the server runs with "
            "--enable-prompt-tokens-details (without it every call is unverified, never cold), "
            "build identity from /version and /v1/models (ids, max_model_len); it cannot prove "
            "cache-entry counts, survival or eviction: no counters",
            "generic": "per-call cached_tokens only if the server sends "
            "usage.prompt_tokens_details or timings.cache_n; build identity is only the model "
            "ids of /v1/models; no counters",
        }.get(profile, "nothing beyond per-call usage")
        d.add("info", "profile", f"server profile {profile}: it can prove {can}.")
        return d
    if block.get("enabled") is False:
        d.add("warn", "enabled", "/health prompt_cache.enabled is false: nothing will resume.")
    mode = block.get("mode")
    if mode is not None:
        d.add(
            "info",
            "mode",
            f"prompt_cache.mode {mode} (2 resumes any shared prefix, 1 exact repeats, 0 off).",
        )
    if block.get("bitwise_identical_to_cold") is False:
        d.add(
            "info",
            "bitwise",
            "bitwise_identical_to_cold is false: a resumed answer may differ from a cold one.",
        )
    if cache_raw is None:
        d.add("warn", "cache", "/cache is not available: counters cannot be read.")
        return d
    counters = CacheCounters.from_server(cache_raw)
    d.numbers["cache"] = counters.to_dict()
    _diagnose_counters(d, counters, block)
    _diagnose_budget(d, health, cache_raw)
    return d


def diagnose_reach(d: Diagnosis, reach: Reach, build_id: str) -> None:
    """Cmax of the latest probe of this build against the registered prefixes (pure)."""
    probe = reach.probe
    if probe is None or probe.cmax is None:
        d.add(
            "info",
            "cmax",
            f"no probe receipt with a Cmax for this build ({build_id}): `prefixreg probe` "
            "measures how many tokens one entry resumes.",
        )
        d.numbers["cmax"] = None
    else:
        d.numbers["cmax"] = probe.cmax
        bound = "at least " if probe.whole else ""
        sizes = ", ".join(f"{s:,}" for s in probe.sizes) or "?"
        where = f"probe of {probe.at}, sizes {sizes} characters"
        if probe.cmax < URGENT_CMAX:
            d.add(
                "warn",
                "cmax",
                f"urgent: Cmax is {probe.cmax:,} tokens ({where}), below {URGENT_CMAX:,}: the "
                "cache does not reach past the system prompt, so a loop re-reads everything "
                f"after it on every call. Raise {CACHE_SIZE_SETTING}.",
            )
        else:
            d.add("info", "cmax", f"Cmax is {bound}{probe.cmax:,} tokens ({where}).")
    for p in reach.prefixes:
        _prefix_fit(d, p, probe)


def _prefix_fit(d: Diagnosis, p: PrefixSpan, probe: ProbeReach | None) -> None:
    label = f"{p.name} ({p.sha256[:12]})"
    if p.tokens is None:
        d.add(
            "info",
            "fit",
            f"{label}: no measurement on this build: `prefixreg warm {p.name}` measures its "
            "token span.",
        )
        return
    if probe is None or probe.cmax is None:
        d.add("info", "fit", f"{label}: about {p.tokens:,} tokens; no Cmax to compare it with.")
        return
    if p.tokens <= probe.cmax:
        d.add(
            "ok",
            "fit",
            f"{label}: about {p.tokens:,} tokens fits in what one entry resumes "
            f"(Cmax {probe.cmax:,}).",
        )
    elif probe.whole:
        d.add(
            "info",
            "fit",
            f"{label}: about {p.tokens:,} tokens, more than the largest size the probe "
            f"resumed (Cmax at least {probe.cmax:,}): not proven; probe a larger size.",
        )
    else:
        d.add(
            "warn",
            "fit",
            f"{label}: about {p.tokens:,} tokens does not fit in one entry: a fresh call "
            f"resumes at most {probe.cmax:,} tokens of it. Raise {CACHE_SIZE_SETTING}.",
        )


def doctor(worker: Worker, registry: Registry | None = None) -> Diagnosis:
    """Read `/health` (and `/cache` on Halogen) and diagnose; with a registry, also compare
    the latest probe's Cmax on this build with the registered prefixes."""
    profile = worker.detect_profile()
    health = worker.health() if profile == "halogen" else {}
    raw = worker.cache_raw() if profile == "halogen" else None
    diagnosis = diagnose(profile, health, raw)
    if registry is not None:
        build_id = worker.server_build().build_id
        diagnosis.numbers["build_id"] = build_id
        diagnose_reach(diagnosis, read_reach(registry, build_id), build_id)
    return diagnosis

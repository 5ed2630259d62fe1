"""`doctor`: what a worker's own `/health` and `/cache` say about its prompt cache.

`diagnose` is pure: it takes the two replies and returns findings in plain words, each
quoting the worker's fields and numbers, plus what to change (`HALOGEN_CACHE_ENTRIES`,
`HALOGEN_CACHE_MB`). `doctor` reads the replies. Nothing here guesses a number the server
did not send: a missing field is said to be missing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import CacheCounters, strict_count
from prefixreg.server.evidence import MEASURED_ENTRIES_PER_REQUEST, lru_survival_stores
from prefixreg.server.worker import Worker

__all__ = ["Diagnosis", "Finding", "diagnose", "doctor"]

MIB: Final = 1 << 20
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


def _diagnose_counters(d: Diagnosis, c: CacheCounters, block: Mapping[str, JSONValue]) -> None:
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
                text + " That is few for a loop that pauses: raise HALOGEN_CACHE_ENTRIES, "
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
                "prefixes rarely live long enough to be resumed. Raise HALOGEN_CACHE_ENTRIES "
                "(or HALOGEN_CACHE_MB on dense), cut foreign traffic, or run "
                "`prefixreg keepalive`.",
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
            f"refused {c.refused:,}: stores the budget could not take. Raise HALOGEN_CACHE_MB.",
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


def doctor(worker: Worker) -> Diagnosis:
    """Read `/health` (and `/cache` on Halogen) and diagnose."""
    profile = worker.detect_profile()
    health = worker.health() if profile == "halogen" else {}
    raw = worker.cache_raw() if profile == "halogen" else None
    return diagnose(profile, health, raw)

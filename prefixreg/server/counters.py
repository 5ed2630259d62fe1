"""`/cache` counter arithmetic: deltas between snapshots, interleaving, LRU survival. Pure.

Invariants: a counter either snapshot lacks gives a None delta (never zero); a window that
cannot be attributed to our own calls (foreign traffic, a restart, unreadable counters) is
interleaved, so nothing measured in it is credited to us.
"""

from __future__ import annotations

from prefixreg.core.records import CACHE_COUNTER_FIELDS, CacheCounters

__all__ = [
    "MEASURED_ENTRIES_PER_REQUEST",
    "counter_deltas",
    "is_interleaved",
    "lru_survival_stores",
    "parse_prometheus",
]

# Entries one prompt stores on the measured Halogen Flash lane (system end, history end).
MEASURED_ENTRIES_PER_REQUEST = 2


def counter_deltas(before: CacheCounters, after: CacheCounters) -> dict[str, int | None]:
    """after - before for every counter; None where either snapshot lacks the field.

    A negative delta on a cumulative counter means the server restarted in between.
    """
    out: dict[str, int | None] = {}
    for name in CACHE_COUNTER_FIELDS:
        b, a = getattr(before, name), getattr(after, name)
        out[name] = None if a is None or b is None else a - b
    return out


def lru_survival_stores(max_entries: int, per_request: int) -> int:
    """Stores a just-used prefix survives in an LRU of `max_entries`: its own `per_request`
    entries are the newest, so every older entry goes first."""
    return max(0, max_entries - per_request)


def is_interleaved(before: CacheCounters, after: CacheCounters, calls: int) -> bool:
    """True when the window cannot be attributed to our `calls` alone.

    That is: `hits + misses` moved by more than the calls made (foreign traffic), moved
    backwards (a restart), or cannot be read on either side (nothing to vouch with).
    """
    deltas = counter_deltas(before, after)
    hits, misses = deltas["hits"], deltas["misses"]
    if hits is None or misses is None or hits < 0 or misses < 0:
        return True
    return hits + misses > calls


def parse_prometheus(raw: bytes) -> dict[str, float]:
    """Prometheus text as samples by name (a sample's labels stay part of its name);
    comment lines and unparsable values are skipped."""
    samples: dict[str, float] = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        # `name{labels} value [timestamp]`; llama.cpp sends neither labels nor timestamps.
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            samples[parts[0]] = float(parts[1])
        except ValueError:
            continue
    return samples

"""Server counters: `/cache` deltas, interleaving, LRU survival, `/metrics` text. Pure.

Invariants: a counter either snapshot lacks gives a None delta (never zero); a window that
cannot be attributed to our own calls (foreign traffic, a restart, unreadable counters) is
interleaved, so nothing measured in it is credited to us.
"""

from __future__ import annotations

from prefixreg.core.errors import UsageError
from prefixreg.core.records import CACHE_COUNTER_FIELDS, CacheCounters

# Entries one prompt stores on the measured Halogen Flash lane (system end, history end).
MEASURED_ENTRIES_PER_REQUEST = 2


def counter_deltas(before: CacheCounters, after: CacheCounters) -> dict[str, int | None]:
    """after - before per counter (None where either lacks it; negative: a restart between)."""
    given: tuple[object, ...] = (before, after)  # callers outside the type checker
    if not all(isinstance(snapshot, CacheCounters) for snapshot in given):
        raise UsageError("counter deltas are taken between two CacheCounters snapshots")
    pairs = ((name, getattr(before, name), getattr(after, name)) for name in CACHE_COUNTER_FIELDS)
    return {name: None if a is None or b is None else a - b for name, b, a in pairs}


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise UsageError(f"{what} must be an int >= 0 (a count)")
    return value


def lru_survival_stores(max_entries: int, per_request: int) -> int:
    """Stores a just-used prefix survives in an LRU of `max_entries` (its entries are newest)."""
    return max(0, _count(max_entries, "max_entries") - _count(per_request, "per_request"))


def is_interleaved(before: CacheCounters, after: CacheCounters, calls: int) -> bool:
    """True when the window cannot be attributed to our `calls` alone: `hits + misses` moved
    by more than the calls made (foreign traffic), moved backwards (a restart), or cannot be
    read on either side (nothing to vouch with)."""
    deltas = counter_deltas(before, after)
    hits, misses = deltas["hits"], deltas["misses"]
    if hits is None or misses is None or hits < 0 or misses < 0:
        return True
    return hits + misses > _count(calls, "calls")


def parse_prometheus(raw: bytes) -> dict[str, float]:
    """Prometheus text as samples by name (labels included); comments, bad values skipped."""
    if not isinstance(raw, bytes):
        raise UsageError(f"parse_prometheus() reads bytes, not {type(raw).__name__}")
    samples: dict[str, float] = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        parts = line.split() if not line.startswith("#") else []  # name{labels} value [time]
        try:
            samples[parts[0]] = float(parts[1])
        except (IndexError, ValueError):
            continue
    return samples

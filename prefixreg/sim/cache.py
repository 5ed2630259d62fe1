"""The simulated prompt cache: an LRU of snapshots and its `/cache` counters. Pure (no I/O).

A snapshot is the token prefix ``tokens[:place]`` of one request, which goes through the cache
as on the real engine. 1. `lookup` when it starts: earlier requests' hit/miss/saved deltas
become visible once ``counter_lag`` later requests have started (Flash: 1; ``stores``,
``evicted``, ``refused``, ``entries``, ``bytes`` never lag); then the longest usable snapshot is
found and refreshed. Flash resumes only an exact prefix of the prompt, whole (a recurrent state
cannot resume mid-way); dense any common prefix rounded down to ``snapshot_align`` and below
the prompt length (a shorter prompt never hits). `count` records the hit or miss (the caller
may have found more on the disk tier). 2. `store`, once the prefill has finished (never before
its state exists): each place (`snapshot_places`) becomes the most recent entry, evicting the
least recent over capacity. Flash 0.7.0 stores every request's snapshots, even equal ones (once
full, every store evicts); dense (``dedupe_snapshots``) refreshes an equal snapshot instead.

The wall: a snapshot of ``t`` tokens needs ``t * token_bytes`` of its fixed-size slab (0: no
wall); a place the slab cannot take, or any when capacity is 0 while enabled, is ``refused``.
Invariants: ``0 <= entries <= capacity``; ``stores - evicted == entries``; cached <= prompt
length (< for dense); counters only grow.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import RenderedPrompt

# Modelled copy costs per snapshot, from the one full Flash /cache sample
# (store_ms_total 3666.5 over 135 stores, restore_ms_total 344.9 over 62 hits).
STORE_MS = 27.2
RESTORE_MS = 5.6


@dataclass(slots=True)
class Counters:
    """The cumulative counters as `/cache` shows them (lagged ones already applied)."""

    entries: int = 0
    bytes: int = 0
    last_entry_bytes: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evicted: int = 0
    refused: int = 0
    prompt_tokens_saved: int = 0
    store_ms_total: float = 0.0
    restore_ms_total: float = 0.0
    last_store_ms: float = 0.0
    last_restore_ms: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        lookups = self.hits + self.misses
        return round(self.hits / lookups, 4) if lookups else None


def _align_down(value: int, align: int) -> int:
    return value - value % align if align > 0 else value


def snapshot_places(prompt: RenderedPrompt, config: SimConfig) -> list[int]:
    """The places this request stores, ascending, each in 1..n. Flash: the first
    ``entries_per_request`` of (system end, history end, last message start, prompt end) that
    exist, aligned down; dense: the last ``entries_per_request`` multiples of the alignment
    strictly below the prompt length."""
    n, k, align = prompt.n, config.entries_per_request, config.snapshot_align
    if not config.flash:
        top = _align_down(n - 1, align) if n > 0 else 0
        places = {top - i * align for i in range(k)}
    else:
        kinds = (prompt.system_end, prompt.history_end, prompt.last_message_start, n)
        places = {_align_down(p, align) for p in kinds[:k] if p is not None}
    return sorted(p for p in places if 0 < p <= n)


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """Length of the common prefix of two token tuples (block compare, then linear)."""
    limit = min(len(a), len(b))
    i, block = 0, 1024
    while i + block <= limit and a[i : i + block] == b[i : i + block]:
        i += block
    while i < limit and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class PromptCache:
    """The LRU and its counters. Not thread-safe: the engine serialises every call."""

    config: SimConfig
    _entries: deque[tuple[str, ...]] = field(default_factory=deque)  # left = least recent
    _counters: Counters = field(default_factory=Counters)
    _pending: deque[int] = field(default_factory=deque)  # lagged lookups: tokens saved

    def lookup(self, prompt: RenderedPrompt) -> int:
        """Publish lagged counters, then find the longest usable snapshot (refreshing it)."""
        config, tokens = self.config, prompt.tokens
        while len(self._pending) > max(config.counter_lag - 1, 0):
            self._apply(self._pending.popleft())
        if not config.cache_enabled:
            return 0
        best, best_index = 0, -1
        for index, entry in enumerate(self._entries):
            if not config.flash:
                usable = min(_common_prefix(entry, tokens), len(tokens) - 1)
                usable = _align_down(usable, config.snapshot_align)
            else:
                usable = len(entry) if tokens[: len(entry)] == entry else 0
            # `>=` so that among equal snapshots the most recent one is refreshed.
            if usable > 0 and usable >= best:
                best, best_index = usable, index
        if best_index >= 0:
            entry = self._entries[best_index]
            del self._entries[best_index]
            self._entries.append(entry)
        return best

    def count(self, cached: int) -> None:
        """Record this request's lookup outcome (`cached` tokens resumed), lagged or not."""
        if self.config.counter_lag > 0:
            self._pending.append(cached)
        else:
            self._apply(cached)

    def _apply(self, saved: int) -> None:
        c = self._counters
        if saved > 0:
            c.hits += 1
            c.prompt_tokens_saved += saved
            c.restore_ms_total += RESTORE_MS
            c.last_restore_ms = RESTORE_MS
        else:
            c.misses += 1

    def store(self, prompt: RenderedPrompt) -> tuple[int, ...]:
        """Store this request's places (call once its prefill has finished); returns the
        places now held (stored, or refreshed when deduplicated)."""
        config, c = self.config, self._counters
        if not config.cache_enabled:
            return ()
        held: list[int] = []
        slab, capacity = config.slab_bytes, config.capacity
        for place in snapshot_places(prompt, config):
            if capacity <= 0 or place * config.token_bytes > slab:
                c.refused += 1
                continue
            snapshot = prompt.tokens[:place]
            held.append(place)
            if config.dedupe_snapshots and snapshot in self._entries:
                self._entries.remove(snapshot)  # held already: refresh it, store nothing
                self._entries.append(snapshot)
                continue
            self._entries.append(snapshot)
            c.stores += 1
            c.last_entry_bytes = slab
            c.store_ms_total += STORE_MS
            c.last_store_ms = STORE_MS
            if len(self._entries) > capacity:
                self._entries.popleft()
                c.evicted += 1
        return tuple(held)

    def counters(self) -> Counters:
        """A copy of the visible counters."""
        c = self._counters
        return dataclasses.replace(
            c,
            entries=len(self._entries),
            bytes=len(self._entries) * self.config.slab_bytes,
            store_ms_total=round(c.store_ms_total, 1),
            restore_ms_total=round(c.restore_ms_total, 1),
        )

"""The simulated prompt cache: an LRU of snapshots and its `/cache` counters. Pure (no I/O).

A snapshot is the token prefix ``tokens[:place]`` of one request. A request goes through the
cache in two steps, as on the real engine:

1. **Look up** (`lookup`, when the request starts). First the hit/miss/saved deltas of earlier
   requests become visible once ``counter_lag`` later requests have started (measured on Flash:
   lag 1, a call's ``prompt_tokens_saved`` and hit/miss deltas land in the next call's window;
   dense has no lag). ``stores``, ``evicted``, ``refused``, ``entries`` and ``bytes`` are never
   lagged. Then the longest usable snapshot is found:

   - ``flash`` (exact places): a snapshot is usable only if it is an exact prefix of the prompt,
     and it resumes exactly its length: an O(1) recurrent state cannot resume mid-way.
   - ``dense`` (partial resume): a snapshot's KV rows resume any common prefix with the prompt,
     rounded down to ``align`` and kept strictly below the prompt length; so cached counts are
     multiples of ``align`` and a prompt shorter than ``align`` never hits.

   A hit refreshes the snapshot's recency. `count` then records one hit or one miss (the
   caller may have found a longer prefix on the disk tier first).
2. **Store** (`store`, only once the request's prefill has finished: a snapshot never exists
   before the state it holds). Each of this request's places (`snapshot_places`) becomes a new
   most-recent entry, evicting the least-recently-used entry when over capacity. Like the
   measured 0.7.0 Flash engine, a store does not look for an equal snapshot already held
   ("snapshot every request"), so once the cache is full every store evicts one entry; dense
   (``dedupe``) refreshes an equal snapshot instead of storing it twice.

The wall: entries have a fixed size (``entry_bytes``, a slab); a snapshot of ``t`` tokens needs
``t * token_bytes`` of its slab (0: no per-token wall), and a place the slab cannot take, or
any place when the budget holds no entry at all (``max_entries`` 0 while ``enabled``), is
refused and counted in ``refused``.

Invariants: ``0 <= entries <= max_entries``; ``stores - evicted == entries``; cached <= prompt
length (and < prompt length for dense); counters only grow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prefixreg.sim.tokenizer import RenderedPrompt

__all__ = [
    "CacheModel",
    "CacheOutcome",
    "Counters",
    "PromptCache",
    "StoreOutcome",
    "snapshot_places",
]

# Modelled copy costs per snapshot, from the one full Flash /cache sample
# (store_ms_total 3666.5 over 135 stores, restore_ms_total 344.9 over 62 hits).
STORE_MS = 27.2
RESTORE_MS = 5.6


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheModel:
    """The parameters of the cache; see `prefixreg.sim.config.SimConfig` for their meaning."""

    max_entries: int
    entries_per_request: int
    align: int
    partial_resume: bool
    counter_lag: int
    entry_bytes: int
    token_bytes: int = 0
    dedupe: bool = False
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class StoreOutcome:
    """What one request's stores did to the cache."""

    stored: int
    evicted: int
    refused: int
    places: tuple[int, ...] = ()  # places now held (stored, or refreshed when deduplicated)


@dataclass(frozen=True, slots=True)
class CacheOutcome:
    """What one request did to the cache (lookup and store together)."""

    cached: int
    stored: int
    evicted: int
    refused: int = 0


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


@dataclass(frozen=True, slots=True)
class _Lagged:
    hit: bool
    saved: int


def _align_down(value: int, align: int) -> int:
    return value - value % align if align > 0 else value


def snapshot_places(prompt: RenderedPrompt, model: CacheModel) -> list[int]:
    """The places this request stores, ascending, each in 1..n.

    Flash: the first ``entries_per_request`` of (system end, history end, last message start,
    prompt end), those that exist, aligned down to ``align`` when it is set. Dense: the last
    ``entries_per_request`` multiples of ``align`` strictly below the prompt length.
    """
    n = prompt.n
    k = model.entries_per_request
    places: set[int] = set()
    if model.partial_resume:
        top = _align_down(n - 1, model.align) if n > 0 else 0
        places = {top - i * model.align for i in range(k)}
    else:
        kinds = (prompt.system_end, prompt.history_end, prompt.last_message_start, n)
        places = {_align_down(p, model.align) for p in kinds[:k] if p is not None}
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
    """The LRU and its counters. Not thread-safe: the server serialises `admit` and `counters`."""

    model: CacheModel
    _entries: deque[tuple[str, ...]] = field(default_factory=deque)  # left = least recent
    _counters: Counters = field(default_factory=Counters)
    _pending: deque[_Lagged] = field(default_factory=deque)

    def admit(self, prompt: RenderedPrompt) -> CacheOutcome:
        """Look up, count and store at once (a request whose prefill takes no time)."""
        cached = self.lookup(prompt)
        self.count(cached)
        out = self.store(prompt)
        return CacheOutcome(cached, out.stored, out.evicted, out.refused)

    def lookup(self, prompt: RenderedPrompt) -> int:
        """Publish lagged counters and find the longest usable snapshot (refreshing it)."""
        self._publish(keep=max(self.model.counter_lag - 1, 0))
        return self._lookup(prompt.tokens)

    def count(self, cached: int) -> None:
        """Record this request's lookup outcome (`cached` tokens resumed), lagged or not."""
        lagged = _Lagged(hit=cached > 0, saved=cached)
        if self.model.counter_lag > 0:
            self._pending.append(lagged)
        else:
            self._apply(lagged)

    def store(self, prompt: RenderedPrompt) -> StoreOutcome:
        """Store this request's places (call once its prefill has finished)."""
        return self._store(prompt)

    def snapshots(self) -> list[tuple[str, ...]]:
        """The held snapshots, least recent first (a copy)."""
        return list(self._entries)

    def counters(self) -> Counters:
        """A copy of the visible counters."""
        c = self._counters
        return Counters(
            entries=len(self._entries),
            bytes=len(self._entries) * self.model.entry_bytes,
            last_entry_bytes=c.last_entry_bytes,
            hits=c.hits,
            misses=c.misses,
            stores=c.stores,
            evicted=c.evicted,
            refused=c.refused,
            prompt_tokens_saved=c.prompt_tokens_saved,
            store_ms_total=round(c.store_ms_total, 1),
            restore_ms_total=round(c.restore_ms_total, 1),
            last_store_ms=c.last_store_ms,
            last_restore_ms=c.last_restore_ms,
        )

    def _publish(self, *, keep: int) -> None:
        while len(self._pending) > keep:
            self._apply(self._pending.popleft())

    def _apply(self, lagged: _Lagged) -> None:
        c = self._counters
        if lagged.hit:
            c.hits += 1
            c.prompt_tokens_saved += lagged.saved
            c.restore_ms_total += RESTORE_MS
            c.last_restore_ms = RESTORE_MS
        else:
            c.misses += 1

    def _lookup(self, tokens: tuple[str, ...]) -> int:
        if not self.model.enabled:
            return 0
        n = len(tokens)
        best, best_index = 0, -1
        for index, entry in enumerate(self._entries):
            if self.model.partial_resume:
                usable = _align_down(min(_common_prefix(entry, tokens), n - 1), self.model.align)
            else:
                usable = len(entry) if len(entry) <= n and tokens[: len(entry)] == entry else 0
            # `>=` so that among equal snapshots the most recent one is refreshed.
            if usable > 0 and usable >= best:
                best, best_index = usable, index
        if best_index >= 0:
            entry = self._entries[best_index]
            del self._entries[best_index]
            self._entries.append(entry)
        return best

    def _store(self, prompt: RenderedPrompt) -> StoreOutcome:
        model = self.model
        if not model.enabled:
            return StoreOutcome(0, 0, 0)
        stored = evicted = refused = 0
        held: list[int] = []
        for place in snapshot_places(prompt, model):
            fits = model.token_bytes == 0 or place * model.token_bytes <= model.entry_bytes
            if model.max_entries <= 0 or not fits:
                refused += 1
                continue
            snapshot = prompt.tokens[:place]
            if model.dedupe and snapshot in self._entries:
                self._entries.remove(snapshot)  # held already: refresh it, store nothing
                self._entries.append(snapshot)
                held.append(place)
                continue
            self._entries.append(snapshot)
            held.append(place)
            stored += 1
            if len(self._entries) > model.max_entries:
                self._entries.popleft()
                evicted += 1
        c = self._counters
        c.stores += stored
        c.evicted += evicted
        c.refused += refused
        if stored:
            c.last_entry_bytes = model.entry_bytes
            c.store_ms_total += STORE_MS * stored
            c.last_store_ms = STORE_MS
        return StoreOutcome(stored, evicted, refused, tuple(held))

"""The simulated prompt cache: an LRU of snapshots ``tokens[:place]`` and its `/cache` counters.
Pure (no I/O); not thread-safe (the engine serialises every call).

`lookup` (a request starts) publishes the hit/miss/saved deltas of requests ``counter_lag``
starts back (the other counters never lag), then finds and refreshes the longest usable
snapshot: Flash resumes only a whole exact prefix of the prompt (a recurrent state cannot resume
mid-way); dense any common prefix rounded down to ``snapshot_align``, below the prompt length.
`store` (once the prefill has finished: never before its state exists) makes each place the
most recent entry, evicting the least recent over capacity; Flash 0.7.0 stores even equal
snapshots, dense (``dedupe_snapshots``) refreshes an equal one instead. The wall: a place
needing more than its slab (``t * token_bytes`` for t tokens), or any when capacity is 0, is
``refused``; the lane held 43,531 tokens in 111 MiB, 2,048 B puts the wall at 56,830 tokens.
Invariants: ``0 <= entries <= capacity``; ``stores - evicted == entries``; cached <= prompt
length (< for dense); counters only grow.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import RenderedPrompt

# Modelled copy costs per snapshot, from the one full Flash /cache sample
# (store_ms_total 3666.5 over 135 stores, restore_ms_total 344.9 over 62 hits).
STORE_MS = 27.2
RESTORE_MS = 5.6


def _align_down(value: int, align: int) -> int:
    return value - value % align if align > 0 else value


def snapshot_places(prompt: RenderedPrompt, config: SimConfig) -> list[int]:
    """The places a request stores, ascending, in 1..n: Flash the first ``entries_per_request``
    of (system end, history end, last message start, prompt end) that exist, aligned down; dense
    the last ``entries_per_request`` multiples of the alignment strictly below the length."""
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


class PromptCache:
    """The LRU (left: least recent) and its counters."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self._entries: deque[tuple[str, ...]] = deque()
        self._counts = dict.fromkeys(
            ("hits", "misses", "stores", "evicted", "refused", "prompt_tokens_saved"), 0
        )
        self._pending: deque[int] = deque()  # lagged lookups: tokens saved

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
            self._entries.append(self._entries[best_index])
            del self._entries[best_index]
        return best

    def count(self, cached: int) -> None:
        """Record this request's lookup outcome (`cached` tokens resumed), lagged or not."""
        if self.config.counter_lag > 0:
            self._pending.append(cached)
        else:
            self._apply(cached)

    def _apply(self, saved: int) -> None:
        self._counts["hits" if saved > 0 else "misses"] += 1
        self._counts["prompt_tokens_saved"] += saved

    def store(self, prompt: RenderedPrompt) -> tuple[int, ...]:
        """Store this request's places (call once its prefill has finished); returns the
        places now held (stored, or refreshed when deduplicated)."""
        config, counts = self.config, self._counts
        if not config.cache_enabled:
            return ()
        held: list[int] = []
        for place in snapshot_places(prompt, config):
            if config.capacity <= 0 or place * config.token_bytes > config.slab_bytes:
                counts["refused"] += 1
                continue
            snapshot = prompt.tokens[:place]
            held.append(place)
            if config.dedupe_snapshots and snapshot in self._entries:
                self._entries.remove(snapshot)  # held already: refresh it, store nothing
                self._entries.append(snapshot)
                continue
            self._entries.append(snapshot)
            counts["stores"] += 1
            if len(self._entries) > config.capacity:
                self._entries.popleft()
                counts["evicted"] += 1
        return tuple(held)

    def counters(self) -> dict[str, Any]:
        """The visible counters, named as in `/cache` (lagged ones applied)."""
        c, slab = self._counts, self.config.slab_bytes
        lookups = c["hits"] + c["misses"]
        return c | {
            "entries": len(self._entries),
            "bytes": len(self._entries) * slab,
            "last_entry_bytes": slab if c["stores"] else 0,
            "store_ms_total": round(c["stores"] * STORE_MS, 1),
            "restore_ms_total": round(c["hits"] * RESTORE_MS, 1),
            "last_store_ms": STORE_MS if c["stores"] else 0.0,
            "last_restore_ms": RESTORE_MS if c["hits"] else 0.0,
            "hit_rate": round(c["hits"] / lookups, 4) if lookups else None,
        }

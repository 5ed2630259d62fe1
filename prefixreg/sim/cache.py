"""The simulated prompt cache's two tiers: the memory LRU of snapshots ``tokens[:place]`` with its
`/cache` counters (`PromptCache`, pure), and the disk tier (`DiskTier`, the simulator's only file
I/O). Neither is thread-safe: the engine serialises every call.

`lookup` (a request starts) publishes the hit/miss/saved deltas of requests ``counter_lag`` starts
back (no other counter lags), then finds and refreshes the longest usable snapshot: Flash resumes
only a whole exact prefix of the prompt (a recurrent state cannot resume mid-way); dense any common
prefix rounded down to ``snapshot_align``, below the prompt length. `store` (once the prefill has
finished: never before its state exists) makes each place the most recent entry, evicting the least
recent over capacity; Flash 0.7.0 stores even equal snapshots, dense (``dedupe_snapshots``)
refreshes an equal one. A place needing more than its slab (``t * token_bytes``; 2,048 B puts the
wall at 56,830 tokens), or any at capacity 0, is ``refused``. Invariants: ``0 <= entries <=
capacity``; ``stores - evicted == entries``; cached <= prompt length (< for dense); counters only
grow.

The disk tier (`--cache-dir`, Flash's ``HALOGEN_CACHE_DIR``) keeps each stored snapshot as a JSON
file under ``<cache_dir>/<build>/`` (a subtree per template, model id and slot size), written to a
temporary file renamed into place: a crash leaves the whole record or none; a failed write (full
disk, directory gone) leaves no temporary file and counts as skipped. On start the subtree is read
back least recently used first (by mtime; a restore touches the file), so entries survive a restart
exactly; a file not regular, not JSON, or not named after its tokens is ignored. A record models
``tokens * disk_token_bytes``; the least recently used are evicted to stay within ``disk_gib``, one
larger than all of it is skipped. A lookup restores the longest record that is an exact prefix of
the prompt. `/cache.disk` (halogen-api.md §1.3): ``hits`` restores, ``misses`` lookups where neither
tier found anything, ``persisted``, ``skipped`` (held, over budget, failed); ``lineages`` (records
extending no other) and ``branches`` (the rest) are the simulator's own definitions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

from prefixreg.core import jsonio
from prefixreg.core.errors import CorruptRecordError, UsageError
from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import TEMPLATE_SHA256, RenderedPrompt, token_digest

# Modelled copy costs per snapshot, from the one full Flash /cache sample
# (store_ms_total 3666.5 over 135 stores, restore_ms_total 344.9 over 62 hits).
STORE_MS = 27.2
RESTORE_MS = 5.6


def _align_down(value: int, align: int) -> int:
    return value - value % align if align > 0 else value


def snapshot_places(prompt: RenderedPrompt, config: SimConfig) -> list[int]:
    """A request's places, ascending, in 1..n: Flash the first ``entries_per_request`` of (system
    end, history end, last message start, end), aligned; dense the last that many multiples of
    the alignment below n."""
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
        if config.max_entries == 0:
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
        """Store this request's places (its prefill has finished); the places now held."""
        config, counts = self.config, self._counts
        if config.max_entries == 0:
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


def _record_name(tokens: tuple[str, ...]) -> str:
    return token_digest(tokens).hex() + ".json"


class DiskTier:
    """Records on disk, indexed name -> tokens, least recent first. Raises `UsageError` if the
    build's subtree cannot be created or read."""

    def __init__(self, config: SimConfig, cache_dir: str) -> None:
        ident = f"{TEMPLATE_SHA256}\n{config.model_id}\n{config.slot_ctx}\n".encode()
        self.dir = Path(cache_dir) / hashlib.sha256(ident).hexdigest()[:16]
        self.config, self.budget_bytes = config, int(config.disk_gib * (1 << 30))
        self.counters = dict.fromkeys(("hits", "misses", "persisted", "evicted", "skipped"), 0)
        self.restored_bytes = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            paths = list(self.dir.iterdir())
        except OSError as exc:
            problem = exc.strerror or exc
            raise UsageError(f"simulator: cannot use cache_dir {cache_dir}: {problem}") from None
        found: list[tuple[float, str, tuple[str, ...]]] = []
        for path in paths:
            if not path.name.endswith(".json") or path.is_symlink() or not path.is_file():
                continue  # temporary files of an interrupted write, or anything not ours
            try:
                body = jsonio.loads(path.read_bytes(), path=path)
                mtime = path.stat().st_mtime
            except (OSError, CorruptRecordError):
                continue  # unreadable: ignored, like a record that was never written
            listed = body.get("tokens") if isinstance(body, dict) else None
            tokens = tuple(str(t) for t in listed) if isinstance(listed, list) else ()
            if tokens and _record_name(tokens) == path.name:
                found.append((mtime, path.name, tokens))
        self._records = OrderedDict((name, tokens) for _, name, tokens in sorted(found))

    @property
    def bytes(self) -> int:
        return sum(len(t) for t in self._records.values()) * self.config.disk_token_bytes

    def resume(self, tokens: tuple[str, ...], cached: int) -> tuple[int, float]:
        """Restore (refresh) the longest record starting `tokens` if longer than `cached`: (its
        length, modelled seconds before `speed`), else (0, 0.0)."""
        best = 0
        for record in self._records.values():
            if best < len(record) <= len(tokens) and tokens[: len(record)] == record:
                best = len(record)
        if best <= cached:
            self.counters["misses"] += cached == 0
            return 0, 0.0
        name = _record_name(tokens[:best])
        self._records.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(self.dir / name)  # recency survives a restart
        size = best * self.config.disk_token_bytes
        self.counters["hits"] += 1
        self.restored_bytes += size
        return best, size / (self.config.disk_read_mbps * 1e6)

    def persist(self, snapshot: tuple[str, ...]) -> None:
        """Write `snapshot` (atomically), then evict least-recently-used records over budget."""
        name = _record_name(snapshot)
        held = name in self._records
        if held or len(snapshot) * self.config.disk_token_bytes > self.budget_bytes:
            self.counters["skipped"] += 1
            if held:
                self._records.move_to_end(name)
            return
        tmp = self.dir / f".{name}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps({"v": 1, "tokens": list(snapshot)}), encoding="utf-8")
            os.replace(tmp, self.dir / name)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.counters["skipped"] += 1
            return
        self._records[name] = snapshot
        self.counters["persisted"] += 1
        while self.bytes > self.budget_bytes and len(self._records) > 1:
            old, _ = self._records.popitem(last=False)
            (self.dir / old).unlink(missing_ok=True)
            self.counters["evicted"] += 1

    def body(self) -> dict[str, Any]:
        """The `/cache` `disk` block."""
        records = list(self._records.values())
        extends = [any(len(o) < len(r) and r[: len(o)] == o for o in records) for r in records]
        n, roots = len(records), extends.count(False)
        body = {"on": True, "records": n, "lineages": roots, "branches": n - roots}
        body |= {"bytes": self.bytes, "budget_bytes": self.budget_bytes, **self.counters}
        restore_ms = round(self.restored_bytes / self.config.disk_read_mbps / 1000, 1)
        return body | {"restore_ms_total": restore_ms, "restored_bytes": self.restored_bytes}

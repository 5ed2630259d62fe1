"""The simulator's engine state: slots and queue, the memory cache, the disk tier, and the
running totals `/metrics` reports. Shared by the handler threads; every method takes the lock.

A request is admitted in two steps (see `prefixreg.sim.cache`): `lookup` when it holds a slot
(memory first, then the disk tier when that resumes more), and `store` only after its modelled
prefill has finished. So of several identical cold requests running at once, none is served
from a snapshot: the first snapshot exists only once the first prefill completes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixreg.core.errors import UsageError
from prefixreg.sim import timing
from prefixreg.sim.cache import CacheModel, Counters, PromptCache
from prefixreg.sim.config import SimConfig
from prefixreg.sim.disk import DiskTier, build_subtree
from prefixreg.sim.protocol import ApiError, Call
from prefixreg.sim.tokenizer import TEMPLATE_SHA256

__all__ = ["Engine", "Lookup"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a request resumed: `cached` tokens, of which `disk_n` came from the disk tier."""

    cached: int
    disk_n: int = 0
    disk_s: float = 0.0  # modelled seconds of the disk restore, before `speed`


@dataclass(slots=True)
class _Hold:
    started: float
    prompt: int
    reserved: int


class Engine:
    """Slots, queue, caches and totals. Thread-safe."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.cache = PromptCache(
            CacheModel(
                max_entries=config.capacity,
                entries_per_request=config.entries_per_request,
                align=config.snapshot_align,
                partial_resume=config.profile == "dense",
                counter_lag=config.counter_lag,
                entry_bytes=config.slab_bytes,
                token_bytes=config.token_bytes,
                dedupe=config.dedupe_snapshots,
                enabled=config.max_entries > 0,
            )
        )
        self.disk: DiskTier | None = None
        if config.cache_dir is not None:
            build = build_subtree(TEMPLATE_SHA256, config.model_id, config.slot_ctx)
            try:
                self.disk = DiskTier(
                    Path(config.cache_dir),
                    build,
                    budget_bytes=int(config.disk_gib * GIB),
                    token_bytes=config.disk_token_bytes,
                )
            except OSError as exc:
                raise UsageError(
                    f"simulator: cannot use cache_dir {config.cache_dir}: {exc.strerror or exc}"
                ) from None
        self.slots = threading.BoundedSemaphore(config.slots)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._holds: dict[int, _Hold] = {}
        self._queued = 0
        self._serial = 0
        self.prompt_tokens_total = 0  # prefilled (not covered by a cache)
        self.prompt_tokens_cached_total = 0  # covered by a cache (memory or disk)
        self.requests_total = 0

    # -- slots ----------------------------------------------------------------------------

    def acquire(self, call: Call) -> int:
        """Wait for a slot; `ApiError` 503 `engine_busy` after the (scaled) queue timeout."""
        with self.lock:
            self._queued += 1
        try:
            got = self.slots.acquire(timeout=self.config.scaled(self.config.queue_timeout))
        finally:
            with self.lock:
                self._queued -= 1
        if not got:
            raise ApiError(
                503,
                "timed out waiting for the engine — halogen serves "
                f"{self.config.slots} request(s) at a time and the queue did not clear",
                code="engine_busy",
            )
        with self.lock:
            self._serial += 1
            n = call.prompt.n
            self._holds[self._serial] = _Hold(time.monotonic(), n, n + call.max_tokens)
            return self._serial

    def release(self, serial: int) -> None:
        with self.lock:
            self._holds.pop(serial, None)
        self.slots.release()

    def sleep(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; False means stop now."""
        return not self.stopping.wait(seconds) if seconds > 0 else not self.stopping.is_set()

    # -- the cache ------------------------------------------------------------------------

    def lookup(self, call: Call) -> Lookup:
        """Find what this request resumes (memory, then disk) and count it."""
        prompt = call.prompt
        with self.lock:
            cached = self.cache.lookup(prompt)
            out = Lookup(cached)
            if self.disk is not None:
                found = self.disk.find(prompt.tokens)
                if found > cached:
                    size = self.disk.restore(prompt.tokens, found)
                    seconds = timing.disk_restore_s(self.config, size)
                    self.disk.counters.restore_ms_total += seconds * 1000
                    out = Lookup(found, found, seconds)
                elif cached == 0:
                    self.disk.counters.misses += 1
            self.cache.count(out.cached)
            self.requests_total += 1
            self.prompt_tokens_total += prompt.n - out.cached
            self.prompt_tokens_cached_total += out.cached
            return out

    def store(self, call: Call) -> None:
        """Store this request's snapshots (its prefill has finished), and persist them."""
        with self.lock:
            out = self.cache.store(call.prompt)
            if self.disk is not None:
                for place in out.places:
                    self.disk.persist(call.prompt.tokens[:place])

    def counters(self) -> Counters:
        with self.lock:
            return self.cache.counters()

    def disk_body(self) -> dict[str, Any] | None:
        with self.lock:
            return None if self.disk is None else self.disk.body()

    def load(self) -> dict[str, Any]:
        with self.lock:
            in_flight = len(self._holds)
            oldest = min((h.started for h in self._holds.values()), default=None)
            queued = self._queued
        return {
            "busy": in_flight >= self.config.slots,
            "slots": self.config.slots,
            "slot_ctx": self.config.slot_ctx,
            "in_flight": in_flight,
            "busy_for_s": round(time.monotonic() - oldest, 3) if oldest is not None else 0.0,
            "queued": queued,
        }

    def pool(self) -> tuple[int, int]:
        """(positions held by in-flight prompts, positions reserved: prompt + max_tokens)."""
        with self.lock:
            held = sum(h.prompt for h in self._holds.values())
            reserved = sum(h.reserved for h in self._holds.values())
        return held, reserved

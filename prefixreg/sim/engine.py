"""The simulator's engine state, shared by the handler threads (every method takes the lock):
slots and queue, the memory cache, the disk tier, and the running totals `/metrics` reports.

A request looks up when it holds a slot (memory, then the disk tier when that resumes more)
and stores only after its modelled prefill: of several identical cold requests at once, none
is served from a snapshot, since the first exists only once the first prefill completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefixreg.sim.cache import Counters, PromptCache
from prefixreg.sim.config import SimConfig
from prefixreg.sim.disk import DiskTier
from prefixreg.sim.request import ApiError, Call


class Engine:
    """Slots, queue, caches and totals. Thread-safe."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.cache = PromptCache(config)
        self.disk = None if config.cache_dir is None else DiskTier(config, config.cache_dir)
        self.slots = threading.BoundedSemaphore(config.slots)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._holds: list[tuple[float, int, int]] = []  # (start, prompt, prompt + max_tokens)
        self._queued = 0
        self.prompt_tokens_total = 0  # prefilled (not covered by a cache)
        self.prompt_tokens_cached_total = 0  # covered by a cache (memory or disk)
        self.requests_total = 0
        self.started = int(time.time())  # /v1/models `created`

    @contextmanager
    def slot(self, call: Call) -> Iterator[None]:
        """Hold a slot for `call`; `ApiError` 503 `engine_busy` after the (scaled) queue timeout."""
        with self.lock:
            self._queued += 1
        try:
            got = self.slots.acquire(timeout=self.config.queue_timeout / self.config.speed)
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
        hold = (time.monotonic(), call.prompt.n, call.prompt.n + call.max_tokens)
        with self.lock:
            self._holds.append(hold)
        try:
            yield
        finally:
            with self.lock:
                self._holds.remove(hold)
            self.slots.release()

    def sleep(self, seconds: float) -> bool:
        """Sleep unless the server is stopping; False means stop now."""
        return not self.stopping.wait(seconds) if seconds > 0 else not self.stopping.is_set()

    def lookup(self, call: Call) -> tuple[int, int, float]:
        """Find what this request resumes (memory, then disk) and count it: (cached tokens,
        of them restored from the disk tier, modelled seconds of that restore)."""
        prompt = call.prompt
        with self.lock:
            found = (self.cache.lookup(prompt), 0, 0.0)
            if self.disk is not None:
                restored, seconds = self.disk.resume(prompt.tokens, found[0])
                if restored:
                    found = (restored, restored, seconds)
            self.cache.count(found[0])
            self.requests_total += 1
            self.prompt_tokens_total += prompt.n - found[0]
            self.prompt_tokens_cached_total += found[0]
            return found

    def store(self, call: Call) -> None:
        """Store this request's snapshots (its prefill has finished), and persist them."""
        with self.lock:
            for place in self.cache.store(call.prompt):
                if self.disk is not None:
                    self.disk.persist(call.prompt.tokens[:place])

    def counters(self) -> tuple[Counters, dict[str, Any] | None]:
        """The memory cache's counters and the disk tier's `/cache` block (None: no tier)."""
        with self.lock:
            return self.cache.counters(), None if self.disk is None else self.disk.body()

    def load(self) -> dict[str, Any]:
        with self.lock:
            in_flight = len(self._holds)
            oldest = min((h[0] for h in self._holds), default=None)
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
            held = sum(h[1] for h in self._holds)
            reserved = sum(h[2] for h in self._holds)
        return held, reserved

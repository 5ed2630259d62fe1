"""The simulator's engine, shared by the handler threads (every method takes the lock): slots
and queue, the memory cache, the disk tier, the running totals, and what `/health`, `/cache`
and `/metrics` report (halogen-api.md §1.2-§1.4) in dense's or Flash's fields.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefixreg.sim import engines, protocol
from prefixreg.sim.cache import DiskTier, PromptCache
from prefixreg.sim.config import MIB, SimConfig
from prefixreg.sim.protocol import ApiError, Call
from prefixreg.sim.tokenizer import TEMPLATE_SHA256

API_VERSION = "0.7.0"  # the Flash release the defaults were measured on
# The request fields /health lists, the same on every server.
_REQUESTS = {
    "supported": [
        "model", "messages", "prompt", *protocol.TOKEN_BUDGET_ALIASES, "stream", "stream_options",
        "stop", "temperature", "top_p", "top_k", "min_p", "seed", "drafter",
    ],
    "token_budget_aliases": list(protocol.TOKEN_BUDGET_ALIASES),
    "max_tokens_default": protocol.MAX_TOKENS_DEFAULT["chat"],
    "error_format": "openai",
    "accepted_but_ignored": ["n"],
}  # fmt: skip
_TIMING = ["store_ms_total", "restore_ms_total", "last_store_ms", "last_restore_ms"]
_FLASH_CACHE = [
    "entries", "max_entries", "bytes", "last_entry_bytes", "hits", "misses", "stores", "evicted",
    "refused", "prompt_tokens_saved", *_TIMING, "rows_copied", "rows_copied_ms", "disk", "hit_rate",
]  # fmt: skip
_DENSE_CACHE = [
    "entries", "bytes", "reserved_bytes", "cap_bytes", "hits", "misses", "stores", "evicted",
    "prompt_tokens_saved", *_TIMING, "refused", "hit_rate",
]  # fmt: skip


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
            n = self.config.slots
            why = f"halogen serves {n} request(s) at a time and the queue did not clear"
            raise ApiError(503, f"timed out waiting for the engine — {why}", code="engine_busy")
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
        """Count what `call` resumes (memory, then disk): (cached, from disk, disk seconds)."""
        prompt = call.prompt
        with self.lock:
            cached = self.cache.lookup(prompt)
            disk = (0, 0.0) if self.disk is None else self.disk.resume(prompt.tokens, cached)
            cached = max(cached, disk[0])  # the disk tier restores only what resumes more
            self.cache.count(cached)
            self.requests_total += 1
            self.prompt_tokens_total += prompt.n - cached
            self.prompt_tokens_cached_total += cached
            return cached, *disk

    def store(self, call: Call) -> None:
        """Store this request's snapshots (its prefill has finished), and persist them."""
        with self.lock:
            for place in self.cache.store(call.prompt):
                if self.disk is not None:
                    self.disk.persist(call.prompt.tokens[:place])

    def health(self) -> dict[str, Any]:
        """`/health`: identity, load (never waits for a slot), the cache's shape, options."""
        config, flash, enabled = self.config, self.config.flash, self.config.max_entries > 0
        with self.lock:
            in_flight, queued = len(self._holds), self._queued
            oldest = min((h[0] for h in self._holds), default=None)
        routes = ["/v1/chat/completions", "/v1/completions", "/v1/models"]
        body: dict[str, Any] = {"status": "ok", "model": config.model_id, "endpoints": routes}
        body |= {"cache_counters": "/cache", "metrics": "/metrics"} if flash else {}
        body["context"] = config.slot_ctx
        if flash:
            body["version"] = {"api": API_VERSION, "engine": API_VERSION, "match": True}
            body["chat_template"] = {"path": None, "sha256": TEMPLATE_SHA256}
        busy_for = round(time.monotonic() - oldest, 3) if oldest is not None else 0.0
        body |= {"busy": in_flight >= config.slots, "slots": config.slots}
        body |= {"slot_ctx": config.slot_ctx, "in_flight": in_flight, "busy_for_s": busy_for}
        body["queued"] = queued
        # Flash 0.17.3 reports 524288 for 4 slots of 262144: two slots' worth.
        body |= {"kv_pool_positions": 2 * config.slot_ctx} if flash else {}
        body |= {"decode": "greedy", "drafters_available": list(protocol.DRAFTERS[config.profile])}
        body["drafter_default"] = "serial"
        # Flash's cap_mb is one entry's size in MiB (116389652 B -> 110), not a budget.
        cap_mb = config.slab_bytes // MIB if flash else config.cap_mb
        cache: dict[str, Any] = {"enabled": enabled, "cap_mb": cap_mb}
        cache |= {"mode": 2 if enabled else 0} if flash else {}
        cache["snapshot_align"] = config.snapshot_align
        cache["bitwise_identical_to_cold"] = not flash and config.snapshot_align == 2048
        body["prompt_cache"] = cache
        body |= {"chat_template_kwargs": sorted(protocol.CHAT_TEMPLATE_KWARGS)} if flash else {}
        # api_key (repr=False) is never shown
        options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.repr}
        body |= _REQUESTS | {"max_tokens_cap": config.max_tokens_cap, "max_tokens_over_cap": "400"}
        return body | {"simulator": {"name": "prefixreg.sim", **options}}

    def models(self) -> dict[str, Any]:
        model = {"id": self.config.model_id, "object": "model", "created": self.started}
        return {"object": "list", "data": [model | {"owned_by": "prefixreg-sim"}]}

    def engine_get(self, path: str) -> Any:
        """A GET route of the engine served (`sim.engines.GET_ROUTES`): JSON, or text."""
        config, engine = self.config, str(self.config.engine)
        model, report, ctx = config.model_id, config.cache_report, config.slot_ctx
        with self.lock:
            cached, in_flight = self.prompt_tokens_cached_total, len(self._holds)
            prompt, requests = self.prompt_tokens_total + cached, self.requests_total
        ollama_model = {"name": model, "model": model, "size": 0, "digest": "0" * 64}
        bodies: dict[str, Any] = {
            "/health": "",
            "/": "Ollama is running",
            "/version": {"version": engines.version(engine, report)},
            "/api/version": {"version": engines.version(engine, report)},
            "/v1/models": engines.models(engine, model, self.started, ctx),
            "/load": {"server_load": in_flight},
            "/model_info": {"model_path": model, "tokenizer_path": model, "is_generation": True},
            "/api/tags": {"models": [ollama_model]},
            "/api/ps": {"models": [ollama_model | {"context_length": ctx}]},
        }
        if path in ("/server_info", "/get_server_info"):
            return engines.server_info(model, report, ctx, config.max_entries > 0)
        if path == "/metrics" and engine == "trtllm":
            return []  # iteration stats (JSON), drained on read; Prometheus is elsewhere
        if path in bodies:
            return bodies[path]
        return engines.metrics(engine, model, prompt, cached, requests)

    def cache_body(self) -> dict[str, Any]:
        """`/cache`: the memory cache's counters, and the disk tier's block when it is on."""
        config = self.config
        with self.lock:
            c, disk = self.cache.counters(), None if self.disk is None else self.disk.body()
        values = c | {"max_entries": config.max_entries, "reserved_bytes": c["bytes"], "disk": disk}
        values |= {"cap_bytes": config.cap_mb * MIB, "rows_copied": 0, "rows_copied_ms": 0.0}
        keys = _FLASH_CACHE if config.flash else _DENSE_CACHE
        return {k: values[k] for k in keys if not (k == "disk" and disk is None)}

    def metrics(self) -> str:
        """Flash `/metrics`: Prometheus text, the cache-related series of halogen-api.md §1.4."""
        pool = 2 * self.config.slot_ctx
        with self.lock:
            held, reserved = sum(h[1] for h in self._holds), sum(h[2] for h in self._holds)
            series = (
                ("halogen:prompt_tokens_cached_total", "counter", self.prompt_tokens_cached_total,
                 "Prompt tokens the prompt cache covered (not processed)."),
                ("llamacpp:prompt_tokens_total", "counter", self.prompt_tokens_total,
                 "Number of prompt tokens processed."),
                ("llamacpp:requests_total", "counter", self.requests_total,
                 "Requests that reached the engine."),
                ("llamacpp:kv_cache_usage_ratio", "gauge", round(held / pool, 6),
                 "KV-cache usage: positions held over the pool."),
                ("halogen:kv_pool_positions", "gauge", pool, "Positions in the KV pool."),
                ("halogen:kv_pool_reserved_tokens", "gauge", reserved,
                 "prompt+max_tokens per admitted front-end slot."),
            )  # fmt: skip
        lines: list[str] = []
        for name, kind, value, text in series:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return "\n".join(lines) + "\n"

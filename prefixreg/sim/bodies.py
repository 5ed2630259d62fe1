"""The simulator's `/health`, `/cache` and `/metrics` bodies, from the config and the engine.

Shapes follow halogen-api.md §1.2-§1.4: the dense field set (``cap_bytes``, no ``version``, no
``/metrics``) or the Flash one (``max_entries``, ``last_entry_bytes``, ``version``,
``chat_template``, ``metrics``). Flash `/cache` carries a ``disk`` block only when the disk tier
is on (the measured 0.7.0 lane has none). Flash `/health` ``prompt_cache.cap_mb`` is one entry's
size in MiB (the slab), dense's the whole budget.
"""

from __future__ import annotations

from typing import Any

from prefixreg.sim import fields, protocol
from prefixreg.sim.cache import Counters
from prefixreg.sim.config import MIB, SimConfig
from prefixreg.sim.engine import Engine
from prefixreg.sim.tokenizer import TEMPLATE_SHA256

__all__ = ["API_VERSION", "cache_body", "health_body", "metrics_text"]

API_VERSION = "0.7.0"  # the Flash release the defaults were measured on


def health_body(config: SimConfig, engine: Engine) -> dict[str, Any]:
    enabled = config.max_entries > 0
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/models"]
    common_tail: dict[str, Any] = {
        "supported": [
            "model",
            "messages",
            "prompt",
            *protocol.TOKEN_BUDGET_ALIASES,
            "stream",
            "stream_options",
            "stop",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "drafter",
        ],
        "token_budget_aliases": list(protocol.TOKEN_BUDGET_ALIASES),
        "max_tokens_default": protocol.MAX_TOKENS_DEFAULT["chat"],
        "error_format": "openai",
        "accepted_but_ignored": ["n"],
        "max_tokens_cap": config.max_tokens_cap,
        "max_tokens_over_cap": "400",
        "simulator": {"name": "prefixreg.sim", "profile": config.profile, "speed": config.speed},
    }
    drafters = {
        "drafters_available": list(fields.DRAFTERS[config.profile]),
        "drafter_default": "serial",
    }
    if config.profile == "dense":
        prompt_cache: dict[str, Any] = {
            "enabled": enabled,
            "cap_mb": config.cap_mb,
            "snapshot_align": config.snapshot_align,
            "bitwise_identical_to_cold": config.snapshot_align == 2048,
        }
        return {
            "status": "ok",
            "model": config.model_id,
            "endpoints": sorted(routes),
            "context": config.slot_ctx,
            **engine.load(),
            "decode": "greedy",
            **drafters,
            "prompt_cache": prompt_cache,
            **common_tail,
        }
    prompt_cache = {
        "enabled": enabled,
        # Flash's cap_mb is one entry's size in MiB (116389652 B -> 110), not a budget.
        "cap_mb": config.slab_bytes // MIB,
        "mode": 2 if enabled else 0,
        "snapshot_align": config.snapshot_align,
        "bitwise_identical_to_cold": False,
    }
    return {
        "status": "ok",
        "model": config.model_id,
        "endpoints": sorted(routes),
        "cache_counters": "/cache",
        "metrics": "/metrics",
        "context": config.slot_ctx,
        "version": {"api": API_VERSION, "engine": API_VERSION, "match": True},
        "chat_template": {"path": None, "sha256": TEMPLATE_SHA256},
        **engine.load(),
        "kv_pool_positions": _pool_positions(config),
        "decode": "greedy",
        **drafters,
        "prompt_cache": prompt_cache,
        "chat_template_kwargs": sorted(fields.CHAT_TEMPLATE_KWARGS),
        **common_tail,
    }


def _pool_positions(config: SimConfig) -> int:
    # Flash 0.17.3 reports kv_pool_positions 524288 for 4 slots of 262144: two slots' worth.
    return 2 * config.slot_ctx


def cache_body(config: SimConfig, c: Counters, disk: dict[str, Any] | None) -> dict[str, Any]:
    timing = {
        "store_ms_total": c.store_ms_total,
        "restore_ms_total": c.restore_ms_total,
        "last_store_ms": c.last_store_ms,
        "last_restore_ms": c.last_restore_ms,
    }
    if config.profile == "dense":
        return {
            "entries": c.entries,
            "bytes": c.bytes,
            "reserved_bytes": c.bytes,
            "cap_bytes": config.cap_mb * MIB,
            "hits": c.hits,
            "misses": c.misses,
            "stores": c.stores,
            "evicted": c.evicted,
            "prompt_tokens_saved": c.prompt_tokens_saved,
            **timing,
            "refused": c.refused,
            "hit_rate": c.hit_rate,
        }
    body: dict[str, Any] = {
        "entries": c.entries,
        "max_entries": config.max_entries,
        "bytes": c.bytes,
        "last_entry_bytes": c.last_entry_bytes,
        "hits": c.hits,
        "misses": c.misses,
        "stores": c.stores,
        "evicted": c.evicted,
        "refused": c.refused,
        "prompt_tokens_saved": c.prompt_tokens_saved,
        **timing,
        "rows_copied": 0,
        "rows_copied_ms": 0.0,
    }
    if disk is not None:
        body["disk"] = disk
    body["hit_rate"] = c.hit_rate
    return body


def metrics_text(config: SimConfig, engine: Engine) -> str:
    """Flash `/metrics`: Prometheus text with the cache-related series of halogen-api.md §1.4."""
    held, reserved = engine.pool()
    pool = _pool_positions(config)
    series: list[tuple[str, str, str, float | int]] = [
        (
            "halogen:prompt_tokens_cached_total",
            "counter",
            "Prompt tokens the prompt cache covered (not processed).",
            engine.prompt_tokens_cached_total,
        ),
        (
            "llamacpp:prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            engine.prompt_tokens_total,
        ),
        (
            "llamacpp:requests_total",
            "counter",
            "Requests that reached the engine.",
            engine.requests_total,
        ),
        (
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "KV-cache usage: positions held over the pool.",
            round(held / pool, 6) if pool else 0.0,
        ),
        ("halogen:kv_pool_positions", "gauge", "Positions in the KV pool.", pool),
        (
            "halogen:kv_pool_reserved_tokens",
            "gauge",
            "prompt+max_tokens per admitted front-end slot.",
            reserved,
        ),
    ]
    lines: list[str] = []
    for name, kind, text, value in series:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"

"""Every body the simulator sends, pure, with halogen-api.md §1's field names:

- errors ``{"error": {"message", "type", "param": null, "code"}}``, ``type`` by status, ``code``
  ``"engine_busy"`` for 503 else null;
- usage ``{prompt_tokens, completion_tokens, total_tokens}``, ``prompt_tokens_details:
  {cached_tokens}`` only when cached > 0; Flash ``timings`` beside it (``cache_n`` always
  there), dense none;
- streams: content frames, a finish frame (empty delta / text, ``finish_reason``, Flash
  ``timings``), with ``include_usage`` a ``choices: []`` frame carrying ``usage`` (earlier
  frames then ``"usage": null``), then ``data: [DONE]``;
- `/health`, `/cache`, `/metrics` (§1.2-§1.4): the dense field set (``cap_bytes``, no
  ``version``, no ``/metrics``) or Flash's (``max_entries``, ``last_entry_bytes``, ``version``,
  ``chat_template``; a ``disk`` block only with the disk tier; ``prompt_cache.cap_mb`` is one
  slab in MiB, dense's the whole budget).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefixreg.sim.config import MIB, SimConfig
from prefixreg.sim.request import (
    CHAT_TEMPLATE_KWARGS,
    DRAFTERS,
    MAX_TOKENS_DEFAULT,
    TOKEN_BUDGET_ALIASES,
    Call,
)
from prefixreg.sim.tokenizer import TEMPLATE_SHA256, answer_tokens

if TYPE_CHECKING:
    from prefixreg.sim.engine import Engine

API_VERSION = "0.7.0"  # the Flash release the defaults were measured on
KEEPALIVE = b": keepalive\n\n"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_SUPPORTED = [
    "model", "messages", "prompt", *TOKEN_BUDGET_ALIASES, "stream", "stream_options", "stop",
    "temperature", "top_p", "top_k", "min_p", "seed", "drafter",
]  # fmt: skip
_TIMING = ["store_ms_total", "restore_ms_total", "last_store_ms", "last_restore_ms"]
_FLASH_CACHE = [
    "entries", "max_entries", "bytes", "last_entry_bytes", "hits", "misses", "stores", "evicted",
    "refused", "prompt_tokens_saved", *_TIMING, "rows_copied", "rows_copied_ms", "disk", "hit_rate",
]  # fmt: skip
_DENSE_CACHE = [
    "entries", "bytes", "reserved_bytes", "cap_bytes", "hits", "misses", "stores", "evicted",
    "prompt_tokens_saved", *_TIMING, "refused", "hit_rate",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Result:
    """One served call: its answer, what it resumed, its durations in real (scaled) seconds."""

    call: Call
    config: SimConfig
    id: str
    created: int
    pieces: tuple[str, ...]
    finish_reason: str
    cached: int
    prompt_s: float
    decode_s: float
    disk_n: int  # of `cached`, restored from the disk tier
    disk_s: float


def result(config: SimConfig, call: Call, found: tuple[int, int, float]) -> Result:
    """Model a call from what its lookup `found` (`Engine.lookup`)."""
    cached, disk_n, disk_s = found
    answer = answer_tokens(call.prompt, config.answer_tokens)
    pieces = tuple(answer[: call.max_tokens])
    prefill = config.prefill_s(prompt=call.prompt.n, cached=cached)
    return Result(
        call=call,
        config=config,
        id=("chatcmpl-" if call.kind == "chat" else "cmpl-") + secrets.token_hex(12),
        created=int(time.time()),
        pieces=pieces,
        finish_reason="stop" if len(pieces) == len(answer) else "length",
        cached=cached,
        prompt_s=(prefill + disk_s) / config.speed,
        decode_s=len(pieces) / config.decode_tps / config.speed,
        disk_n=disk_n,
        disk_s=disk_s / config.speed,
    )


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope Halogen uses."""
    if code is None and status == 503:
        code = "engine_busy"
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def usage(result: Result) -> dict[str, Any]:
    """The usage object; `prompt_tokens_details` only when something was cached."""
    prompt_n, completion_n = result.call.prompt.n, len(result.pieces)
    body: dict[str, Any] = {
        "prompt_tokens": prompt_n,
        "completion_tokens": completion_n,
        "total_tokens": prompt_n + completion_n,
    }
    if result.cached > 0:
        body["prompt_tokens_details"] = {"cached_tokens": result.cached}
    return body


def timings(result: Result) -> dict[str, Any]:
    """Flash `timings`: llama.cpp-style, `prompt_n` is what was actually prefilled."""
    prompt_n, predicted_n = result.call.prompt.n - result.cached, len(result.pieces)
    body: dict[str, Any] = {
        "prompt_n": prompt_n,
        "prompt_ms": round(result.prompt_s * 1000, 3),
        "prompt_per_second": round(prompt_n / result.prompt_s, 3) if result.prompt_s else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": round(result.decode_s * 1000, 3),
        "predicted_per_second": (
            round(predicted_n / result.decode_s, 3) if result.decode_s else 0.0
        ),
        "cache_n": result.cached,
        "draft_n": 0,
        "draft_n_accepted": 0,
    }
    if result.config.cache_dir is not None:  # the disk tier is on
        body["disk_restore_n"] = result.disk_n
        body["disk_restore_ms"] = round(result.disk_s * 1000, 3)
    return body


def _body(result: Result, finish: str | None, text: str | None, *, chunk: bool) -> dict[str, Any]:
    """The envelope with one choice: a message (chat), a delta (chat stream) or a text
    (completions); `text` None is a stream's finish frame."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if result.call.kind == "completion":
        choice["text"] = text or ""
    elif chunk:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    kind = "chat.completion.chunk" if chunk else "chat.completion"
    body: dict[str, Any] = {
        "id": result.id,
        "created": result.created,
        "model": result.config.model_id,
        "object": "text_completion" if result.call.kind == "completion" else kind,
        "choices": [choice],
    }
    if chunk and result.call.include_usage:
        body["usage"] = None
    return body


def response_body(result: Result) -> dict[str, Any]:
    """The non-streaming reply."""
    body = _body(result, result.finish_reason, "".join(result.pieces), chunk=False)
    body["usage"] = usage(result)
    if result.config.flash:
        body["timings"] = timings(result)
    return body


def content_frame(result: Result, piece: str) -> bytes:
    """One streamed piece of the answer."""
    return sse(_body(result, None, piece, chunk=True))


def final_frames(result: Result) -> bytes:
    """The finish frame (with flash `timings`), the usage frame if asked for, and [DONE]."""
    finish = _body(result, result.finish_reason, None, chunk=True)
    if result.config.flash:
        finish["timings"] = timings(result)
    frames = [sse(finish)]
    if result.call.include_usage:
        last = _body(result, None, None, chunk=True) | {"choices": [], "usage": usage(result)}
        frames.append(sse(last))
    return b"".join(frames) + sse("[DONE]")


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One SSE `data:` frame; a str payload is sent as is (`[DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def health_body(config: SimConfig, engine: Engine) -> dict[str, Any]:
    flash, enabled = config.flash, config.cache_enabled
    routes = ["/v1/chat/completions", "/v1/completions", "/v1/models"]
    body: dict[str, Any] = {"status": "ok", "model": config.model_id, "endpoints": routes}
    if flash:
        body |= {"cache_counters": "/cache", "metrics": "/metrics"}
    body["context"] = config.slot_ctx
    if flash:
        body["version"] = {"api": API_VERSION, "engine": API_VERSION, "match": True}
        body["chat_template"] = {"path": None, "sha256": TEMPLATE_SHA256}
    body |= engine.load()
    if flash:  # Flash 0.17.3 reports 524288 for 4 slots of 262144: two slots' worth
        body["kv_pool_positions"] = 2 * config.slot_ctx
    body |= {"decode": "greedy", "drafters_available": list(DRAFTERS[config.profile])}
    body["drafter_default"] = "serial"
    # Flash's cap_mb is one entry's size in MiB (116389652 B -> 110), not a budget.
    cache: dict[str, Any] = {"enabled": enabled, "cap_mb": config.slab_bytes // MIB}
    if flash:
        cache["mode"] = 2 if enabled else 0
    else:
        cache["cap_mb"] = config.cap_mb
    cache["snapshot_align"] = config.snapshot_align
    cache["bitwise_identical_to_cold"] = not flash and config.snapshot_align == 2048
    body["prompt_cache"] = cache
    if flash:
        body["chat_template_kwargs"] = sorted(CHAT_TEMPLATE_KWARGS)
    options = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    del options["api_key"]  # never shown
    return body | {
        "supported": _SUPPORTED,
        "token_budget_aliases": list(TOKEN_BUDGET_ALIASES),
        "max_tokens_default": MAX_TOKENS_DEFAULT["chat"],
        "error_format": "openai",
        "accepted_but_ignored": ["n"],
        "max_tokens_cap": config.max_tokens_cap,
        "max_tokens_over_cap": "400",
        "simulator": {"name": "prefixreg.sim", **options},
    }


def models_body(config: SimConfig, engine: Engine) -> dict[str, Any]:
    model = {"id": config.model_id, "object": "model", "created": engine.started}
    return {"object": "list", "data": [model | {"owned_by": "prefixreg-sim"}]}


def cache_body(config: SimConfig, engine: Engine) -> dict[str, Any]:
    c, disk = engine.counters()
    values = dataclasses.asdict(c) | {
        "max_entries": config.max_entries,
        "reserved_bytes": c.bytes,
        "cap_bytes": config.cap_mb * MIB,
        "rows_copied": 0,
        "rows_copied_ms": 0.0,
        "disk": disk,
        "hit_rate": c.hit_rate,
    }
    keys = _FLASH_CACHE if config.flash else _DENSE_CACHE
    return {k: values[k] for k in keys if not (k == "disk" and disk is None)}


def metrics_text(config: SimConfig, engine: Engine) -> str:
    """Flash `/metrics`: Prometheus text with the cache-related series of halogen-api.md §1.4."""
    held, reserved = engine.pool()
    pool = 2 * config.slot_ctx
    series = (
        ("halogen:prompt_tokens_cached_total", "counter", engine.prompt_tokens_cached_total,
         "Prompt tokens the prompt cache covered (not processed)."),
        ("llamacpp:prompt_tokens_total", "counter", engine.prompt_tokens_total,
         "Number of prompt tokens processed."),
        ("llamacpp:requests_total", "counter", engine.requests_total,
         "Requests that reached the engine."),
        ("llamacpp:kv_cache_usage_ratio", "gauge", round(held / pool, 6) if pool else 0.0,
         "KV-cache usage: positions held over the pool."),
        ("halogen:kv_pool_positions", "gauge", pool, "Positions in the KV pool."),
        ("halogen:kv_pool_reserved_tokens", "gauge", reserved,
         "prompt+max_tokens per admitted front-end slot."),
    )  # fmt: skip
    lines: list[str] = []
    for name, kind, value, text in series:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"

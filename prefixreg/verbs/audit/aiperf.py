"""NVIDIA aiperf's per-request exports (0.13, and older lines that write nulls), read as calls.
Pure. `profile_export.jsonl` (`MetricRecordInfo`: `metadata`, `metrics` tag -> {value, unit})
keeps the server's counts: `usage_prompt_tokens`, `usage_completion_tokens`,
`usage_prompt_cache_read_tokens` (absent when the server reported none: the call is then
unverified, never 0 cached). `profile_export_raw.jsonl` (`RawRecordInfo`) keeps the server's own
lines (`responses[].packets[].value`, `[DONE]` included, or a whole response's `text`) and the
request body (`payload`). Both carry `metadata.request_start_ns` / `request_end_ns` (epoch ns):
the call's interval, zero-length for an HTTP error. A record with an `error` is an unverified
call; a warm-up request is not in the profiled batch. Unknown tags and fields are ignored; a
missing field is its default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixreg.core.errors import CorruptRecordError
from prefixreg.core.jsonio import loads
from prefixreg.core.records import strict_count


@dataclass(frozen=True, slots=True)
class AiperfCall:
    """One aiperf request: the `reply` to judge, its request body if kept, its interval, and
    whether it came from the raw export."""

    request_id: str | None
    raw: bool
    reply: object
    request: dict[str, Any] | None
    start_ns: int | None
    end_ns: int | None
    error: str | None = None


def is_aiperf(value: Mapping[str, object]) -> bool:
    meta = value.get("metadata")
    known = "metrics" in value or "responses" in value
    return known and isinstance(meta, dict) and "request_start_ns" in meta


def _metric(metrics: object, tag: str) -> object:
    entry = metrics.get(tag) if isinstance(metrics, dict) else None
    return entry.get("value") if isinstance(entry, dict) else None


def _sse(responses: object) -> object:
    """The raw export's responses as the server's SSE body (or its one whole response)."""
    lines: list[str] = []
    for r in responses if isinstance(responses, list) else ():
        if isinstance(r, dict) and isinstance(r.get("text"), str) and "packets" not in r:
            try:
                return loads(r["text"])
            except CorruptRecordError:
                return r["text"].encode("utf-8", "surrogatepass")  # judged malformed later
        packets = r.get("packets") if isinstance(r, dict) else None
        for p in packets if isinstance(packets, list) else ():
            if isinstance(p, dict) and p.get("name") == "data" and isinstance(p.get("value"), str):
                lines += [*(f"data: {line}" for line in p["value"].split("\n")), ""]
    return "\n".join([*lines, ""]).encode("utf-8", "surrogatepass")


def read_aiperf(value: Mapping[str, Any]) -> AiperfCall | str:
    """The call an aiperf record holds, or why it is not one of the batch's calls."""
    meta: dict[str, Any] = value["metadata"]
    if meta.get("benchmark_phase") == "warmup":
        return "an aiperf warm-up request (not part of the profiled batch)"
    start = strict_count(meta.get("request_start_ns"))
    end = strict_count(meta.get("request_end_ns"))
    if start is None or end is None or end < start:
        start = end = None
    rid = meta.get("x_request_id") if isinstance(meta.get("x_request_id"), str) else None
    if rid is None and start is not None:  # both exports carry the same metadata: a request
        corr = meta.get("x_correlation_id")  # without an id is known by its times
        rid = f"{corr if isinstance(corr, str) else ''}@{start}-{end}"
    raw = "responses" in value
    payload = value.get("payload")
    request = payload if isinstance(payload, dict) and "messages" in payload else None
    error = value.get("error")
    if isinstance(error, dict):  # the status only: the server's text is never kept
        code = strict_count(error.get("code"))
        why = "aiperf: the request failed" + ("" if code is None else f" (HTTP {code})")
        return AiperfCall(rid, raw, {"error": {"code": code}}, request, start, end, why)
    if raw:
        return AiperfCall(rid, True, _sse(value.get("responses")), request, start, end)
    m = value.get("metrics")
    usage = {key: _metric(m, f"usage_{key}") for key in ("prompt_tokens", "completion_tokens")}
    if (cached := _metric(m, "usage_prompt_cache_read_tokens")) is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    # aiperf writes a record only for a finished request; it keeps the counts, not the text.
    choice = {"index": 0, "finish_reason": "stop", "message": {"content": ""}}
    reply = {"object": "chat.completion", "choices": [choice], "usage": usage}
    return AiperfCall(rid, False, reply, None, start, end)

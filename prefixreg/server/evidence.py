"""Evidence: what a server's reply proves about one call (DESIGN §4). Pure: no I/O.

Input is whatever the caller holds: a non-streamed response dict, the decoded chunks of an
SSE stream (with whether `data: [DONE]` arrived), the raw SSE bytes, an already folded
`ReplyReader`, or an OpenAI SDK object (read by duck typing: `model_dump()`, `to_dict()` or
`__dict__`). Output is a `CallEvidence`. SSE decoding lives in `server.sse`, reply reading in
`server.replies`, `/cache` arithmetic in `server.counters`; their names are re-exported here.

Invariants (the contract is DESIGN §4; these are its rules as code):

- A count is valid only if its type is exactly `int` and it is >= 0 (`records.strict_count`).
  A missing count is never zero.
- `cached_tokens` comes from `usage.prompt_tokens_details.cached_tokens`, else from
  `timings.cache_n`; `cached_source` names the one used. A source that is *present but
  malformed* (8.0, "8", true, -1, a list) makes the call unverified: it is malformed usage,
  and the next source is not consulted to paper over it.
- Tokens restored from the server's disk tier (`timings.disk_restore_n`, with
  `disk_restore_ms`) are recorded as such. They were not prefilled, so they are resumed
  tokens: when the restore count exceeds the cached count read above (or that count is
  missing), the restore count is the cached count and `cached_source` says so. The two
  are never added: whether a server counts its disk restores inside `cache_n` is not
  documented, and the larger of the two is a lower bound either way (never lost, never
  double-counted).
- `cold` = complete, valid prompt and cached counts, cached == 0. `reused` = complete,
  0 < cached <= prompt. Anything else is `unverified`, and `reason` says why in words.
  Completeness is `ReplyReader`'s rule: a finished stream or a final response, never one
  mid-stream chunk. An incomplete call has no `output_sha256`, `token_sha` or `ttft_s`.
- `error` is a short code of ours ("incomplete_stream", "server_stream_error", ...): the
  server's error message text is never kept. Neither is the output text: only its hash.
- `output_sha256` = sha256(sha256(content) || sha256(reasoning)) over the UTF-8 bytes of
  the concatenated pieces, so it does not depend on where the chunks were cut.
- `token_sha` is read only from `tensorfold.token_sha` and only if it is 12 or 64
  lowercase hex digits; `token_equal` is None (unverified) unless both sides carry one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import cast

from prefixreg.core.digest import output_digest
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import CacheState, CallEvidence, strict_count
from prefixreg.server.counters import (
    MEASURED_ENTRIES_PER_REQUEST,
    counter_deltas,
    is_interleaved,
    lru_survival_stores,
)
from prefixreg.server.replies import ReplyReader, to_plain
from prefixreg.server.sse import SSEParser, SSEStream, parse_sse

__all__ = [
    "MEASURED_ENTRIES_PER_REQUEST",
    "SOURCE_DISK",
    "SOURCE_TIMINGS",
    "SOURCE_USAGE",
    "ReplyReader",
    "SSEParser",
    "SSEStream",
    "assemble_reply",
    "counter_deltas",
    "evidence_from_chunks",
    "evidence_from_reader",
    "evidence_from_response",
    "evidence_from_sse",
    "is_interleaved",
    "lru_survival_stores",
    "parse_sse",
    "read_reply",
    "to_plain",
    "token_equal",
]

SOURCE_USAGE = "usage.prompt_tokens_details.cached_tokens"
SOURCE_TIMINGS = "timings.cache_n"
SOURCE_DISK = "timings.disk_restore_n"

_TOKEN_SHA = re.compile(r"[0-9a-f]{12}|[0-9a-f]{64}")


def _why_invalid(name: str, value: object) -> str:
    if value is None:
        return f"{name} missing"
    if isinstance(value, bool):
        return f"{name} is a boolean"
    if isinstance(value, int):
        return f"{name} is negative"
    kinds: tuple[tuple[type, str], ...] = (
        (float, "a float"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    )
    for kind, words in kinds:
        if isinstance(value, kind):
            return f"{name} is {words}"
    return f"{name} is a {type(value).__name__}"


def _number(value: object) -> float | None:
    if type(value) is not int and type(value) is not float:
        return None
    number = float(cast(float, value))
    return number if math.isfinite(number) and number >= 0 else None


_MISSING = "cached_tokens missing (no prompt_tokens_details, no timings.cache_n)"


def _reported(usage: Mapping[str, object], timings: object) -> tuple[int | None, str | None, str]:
    """(cached, source, reason-if-None) from usage or cache_n: the first present decides."""
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        return None, None, _why_invalid("prompt_tokens_details", details)
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        raw = details["cached_tokens"]
        count = strict_count(raw)
        if count is None:
            return None, None, _why_invalid("cached_tokens", raw)
        return count, SOURCE_USAGE, ""
    if timings is not None and not isinstance(timings, dict):
        return None, None, _why_invalid("timings", timings)
    if isinstance(timings, dict) and timings.get("cache_n") is not None:
        raw = timings["cache_n"]
        count = strict_count(raw)
        if count is None:
            return None, None, _why_invalid("timings.cache_n", raw)
        return count, SOURCE_TIMINGS, ""
    return None, None, _MISSING


def _cached(
    usage: Mapping[str, object], timings: object
) -> tuple[int | None, str | None, str, int | None]:
    """(cached, source, reason-if-None, disk-restored tokens): see the disk-tier rule."""
    cached, source, reason = _reported(usage, timings)
    raw = timings.get("disk_restore_n") if isinstance(timings, dict) else None
    if raw is None:
        return cached, source, reason, None
    restored = strict_count(raw)
    if restored is None:
        return None, None, _why_invalid("timings.disk_restore_n", raw), None
    if reason and reason != _MISSING:
        return None, None, reason, restored  # a malformed source is not papered over
    if restored > 0 and (cached is None or restored > cached):
        return restored, SOURCE_DISK, "", restored
    return cached, source, reason, restored


def _judge(reply: ReplyReader, *, wall_s: float | None, ttft_s: float | None) -> CallEvidence:
    usage_obj = reply.usage
    usage: Mapping[str, object] = usage_obj if isinstance(usage_obj, dict) else {}
    prompt = strict_count(usage.get("prompt_tokens"))
    completion = strict_count(usage.get("completion_tokens"))
    cached, source, cached_reason, restored = _cached(usage, reply.timings)

    reason: str | None
    state: CacheState = "unverified"
    if not reply.complete:
        reason = reply.reason
    elif usage_obj is None:
        reason = "usage missing"
    elif not isinstance(usage_obj, dict):
        reason = _why_invalid("usage", usage_obj)
    elif prompt is None:
        reason = _why_invalid("prompt_tokens", usage.get("prompt_tokens"))
    elif cached is None:
        reason = cached_reason
    elif cached > prompt:
        reason = "cached_tokens > prompt_tokens"
    else:
        reason = None
        state = "cold" if cached == 0 else "reused"

    timings: Mapping[str, object] = reply.timings if isinstance(reply.timings, dict) else {}
    digest = None
    token_sha = None
    if reply.complete:
        digest = output_digest(bytes(reply.content), bytes(reply.reasoning))
        runtime = reply.runtime
        raw_sha = runtime.get("token_sha") if isinstance(runtime, dict) else None
        if isinstance(raw_sha, str) and _TOKEN_SHA.fullmatch(raw_sha):
            token_sha = raw_sha
    return CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cached_source=source,
        cache_state=state,
        complete=reply.complete,
        output_sha256=digest,
        token_sha=token_sha,
        ttft_s=_number(ttft_s) if reply.complete else None,
        wall_s=_number(wall_s),
        prompt_ms=_number(timings.get("prompt_ms")),
        predicted_ms=_number(timings.get("predicted_ms")),
        disk_restore_tokens=restored,
        disk_restore_ms=_number(timings.get("disk_restore_ms")),
        error=reply.error,
        reason=reason,
    )


def evidence_from_reader(
    reply: ReplyReader, *, wall_s: float | None = None, ttft_s: float | None = None
) -> CallEvidence:
    """Evidence from a reply already folded by a `ReplyReader` (the worker's stream path)."""
    return _judge(reply, wall_s=wall_s, ttft_s=ttft_s)


def _read_chunks(chunks: Iterable[object], *, done: bool, malformed: str | None) -> ReplyReader:
    reply = ReplyReader()
    for frame in chunks:
        reply.take_frame(to_plain(frame))
    reply.end_stream(done=done, malformed=malformed)
    return reply


def read_reply(resp: object, *, done: bool | None = None) -> ReplyReader:
    """Fold any input `evidence_from_response` takes into a `ReplyReader`."""
    if isinstance(resp, ReplyReader):
        return resp
    if isinstance(resp, SSEStream):
        return _read_chunks(resp.chunks, done=resp.done, malformed=resp.malformed)
    plain = to_plain(resp)
    if isinstance(plain, list):
        return _read_chunks(plain, done=done is True, malformed=None)
    reply = ReplyReader()
    reply.take_response(plain)
    return reply


def evidence_from_chunks(
    chunks: Iterable[object],
    *,
    done: bool,
    wall_s: float | None = None,
    ttft_s: float | None = None,
    malformed: str | None = None,
) -> CallEvidence:
    """Evidence from the decoded frames of a stream; `done` says whether `[DONE]` arrived.

    `malformed` is the parser's reason when some line could not be read (see `SSEStream`).
    Frames may be dicts or SDK chunk objects.
    """
    reply = _read_chunks(chunks, done=done, malformed=malformed)
    return _judge(reply, wall_s=wall_s, ttft_s=ttft_s)


def evidence_from_sse(
    data: bytes | str | Iterable[bytes | str] | SSEStream,
    *,
    wall_s: float | None = None,
    ttft_s: float | None = None,
) -> CallEvidence:
    """Evidence from a raw SSE body (or an already parsed `SSEStream`)."""
    stream = data if isinstance(data, SSEStream) else parse_sse(data)
    return evidence_from_chunks(
        stream.chunks, done=stream.done, wall_s=wall_s, ttft_s=ttft_s, malformed=stream.malformed
    )


def evidence_from_response(
    resp: object,
    *,
    done: bool | None = None,
    wall_s: float | None = None,
    ttft_s: float | None = None,
) -> CallEvidence:
    """Evidence from what a call returned.

    - a non-streamed response (dict or SDK object): complete only as a final response (see
      `server.replies`); one stream chunk passed here is never complete, never `cold`;
    - a list of stream chunks (dicts or SDK objects): pass `done=True` only if the stream
      ended with `[DONE]` (an SDK stream iterated to its end did); anything else is
      treated as a truncated stream;
    - an `SSEStream` from `parse_sse`, or a `ReplyReader`.
    """
    return _judge(read_reply(resp, done=done), wall_s=wall_s, ttft_s=ttft_s)


def assemble_reply(resp: object, *, done: bool | None = None) -> JSONObject:
    """A flat, response-like view of a reply: what a caller wants to read, not evidence.

    Keys: `content`, `reasoning` (None when empty), `finish_reason`, `usage`, `timings`,
    `model`, `id`. Takes the same inputs as `evidence_from_response`. Holds the output text,
    so it is for the caller, never for a record.
    """
    reply = read_reply(resp, done=done)
    content, reasoning = reply.text()
    return {
        "content": content,
        "reasoning": reasoning or None,
        "finish_reason": reply.finish_reason,
        "usage": _json(reply.usage),
        "timings": _json(reply.timings),
        "model": reply.model,
        "id": reply.id,
    }


def _json(value: object) -> JSONValue:
    """Keep a decoded JSON value as such (it came from orjson or to_plain)."""
    if value is None or isinstance(value, str | int | float | bool | dict | list):
        return value  # decoded JSON: nested values are JSON too
    return None


def token_equal(a: CallEvidence, b: CallEvidence) -> bool | None:
    """Whether two calls produced the same tokens: None unless both are complete and error
    free and both carry a `token_sha` (absent on both sides is still None, never a pass)."""
    for ev in (a, b):
        if ev.error is not None or not ev.complete or ev.token_sha is None:
            return None
    return a.token_sha == b.token_sha

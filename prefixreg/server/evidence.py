"""Evidence: what a server's reply proves about one call (DESIGN §4). Pure: no I/O.

Input is whatever the caller holds: a non-streamed response dict, the decoded chunks of an
SSE stream (with whether `data: [DONE]` arrived), the raw SSE bytes, or an OpenAI SDK
object (read by duck typing: `model_dump()`, `to_dict()` or `__dict__`). Output is a
`CallEvidence`.

Invariants (the contract is DESIGN §4; these are its rules as code):

- A count is valid only if its type is exactly `int` and it is >= 0 (`records.strict_count`).
  A missing count is never zero.
- `cached_tokens` comes from `usage.prompt_tokens_details.cached_tokens`, else from
  `timings.cache_n`; `cached_source` names the one used. A source that is *present but
  malformed* (8.0, "8", true, -1, a list) makes the call unverified: it is malformed usage,
  and the next source is not consulted to paper over it.
- `cold` = complete, valid prompt and cached counts, cached == 0. `reused` = complete,
  0 < cached <= prompt. Anything else is `unverified`, and `reason` says why in words.
- A stream is complete only if it ended with `[DONE]`, every `data:` line was JSON, no
  frame carried an `error`, and every text piece was a string. An incomplete call has no
  `output_sha256`, no `token_sha` and no `ttft_s`.
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
from dataclasses import dataclass, field
from typing import cast

import orjson

from prefixreg.core.digest import output_digest
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.records import (
    CACHE_COUNTER_FIELDS,
    CacheCounters,
    CacheState,
    CallEvidence,
    strict_count,
)

__all__ = [
    "MEASURED_ENTRIES_PER_REQUEST",
    "SOURCE_TIMINGS",
    "SOURCE_USAGE",
    "SSEParser",
    "SSEStream",
    "assemble_reply",
    "counter_deltas",
    "evidence_from_chunks",
    "evidence_from_response",
    "evidence_from_sse",
    "is_interleaved",
    "lru_survival_stores",
    "parse_sse",
    "to_plain",
    "token_equal",
]

SOURCE_USAGE = "usage.prompt_tokens_details.cached_tokens"
SOURCE_TIMINGS = "timings.cache_n"

_TOKEN_SHA = re.compile(r"[0-9a-f]{12}|[0-9a-f]{64}")
_MAX_DEPTH = 64


# --------------------------------------------------------------------------------------
# SSE


@dataclass(slots=True)
class SSEStream:
    """The decoded `data:` frames of one stream.

    `chunks` holds each frame's JSON value in order (a non-object value is kept and judged
    later). `done` is True once `data: [DONE]` arrived. `malformed` is the first reason the
    stream could not be read (a `data:` line that is not JSON, bytes that are not UTF-8).
    """

    chunks: list[object] = field(default_factory=list)
    done: bool = False
    malformed: str | None = None


class SSEParser:
    """Incremental SSE reader: feed bytes (or whole lines) as they arrive.

    Blank lines, comment lines (`: keepalive`) and other SSE fields (`event:`, `id:`) are
    ignored. Each `data:` line is one JSON document; `data: [DONE]` ends the stream and
    anything after it is ignored. Lines end with LF (a CR before it is stripped). An event
    split over several `data:` lines, which OpenAI-compatible servers do not send, reads as
    malformed: unverified, never a guess.
    """

    def __init__(self) -> None:
        self._pending: list[bytes] = []  # pieces of the line not yet ended
        self.stream = SSEStream()

    def feed(self, data: bytes) -> list[object]:
        """Take the next bytes of the body; return the frames completed by them."""
        if b"\n" not in data:
            # Keep pieces and join once the line ends: re-scanning a growing buffer on every
            # small piece would make one long line quadratic.
            self._pending.append(data)
            return []
        *lines, rest = data.split(b"\n")
        lines[0] = b"".join([*self._pending, lines[0]])
        self._pending = [rest] if rest else []
        out: list[object] = []
        for line in lines:
            frame = self.feed_line(line)
            if frame is not None:
                out.append(frame)
        return out

    def feed_line(self, line: bytes | str) -> object | None:
        """Take one line (without its newline); return its frame, if it carried one."""
        if self.stream.done:
            return None
        if isinstance(line, bytes):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                self._malformed("the stream is not UTF-8")
                return None
        else:
            text = line
        text = text.strip()
        if not text or text.startswith(":") or not text.startswith("data:"):
            return None
        payload = text[5:].strip()
        if payload == "[DONE]":
            self.stream.done = True
            return None
        try:
            frame: object = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._malformed("a data: line is not JSON")
            return None
        self.stream.chunks.append(frame)
        return frame

    def finish(self) -> SSEStream:
        """End of body: read a last unterminated line, and return the stream."""
        if self._pending:
            rest, self._pending = b"".join(self._pending), []
            self.feed_line(rest)
        return self.stream

    def _malformed(self, reason: str) -> None:
        if self.stream.malformed is None:
            self.stream.malformed = reason


def parse_sse(data: bytes | str | Iterable[bytes | str]) -> SSEStream:
    """Decode a whole SSE body.

    `data` is the body as bytes or text, or an iterable of `bytes` pieces (cut anywhere, as
    they came off the socket) or of `str` lines (as from `iter_lines()`; newlines optional).
    """
    parser = SSEParser()
    if isinstance(data, str):
        data = data.encode("utf-8")
    if isinstance(data, bytes):
        parser.feed(data)
        return parser.finish()
    for piece in data:
        if isinstance(piece, bytes):
            parser.feed(piece)
        else:
            for line in piece.split("\n"):
                parser.feed_line(line)
    return parser.finish()


# --------------------------------------------------------------------------------------
# Reading replies


def to_plain(obj: object, _depth: int = 0) -> object:
    """Turn an SDK object (pydantic `model_dump()`, `to_dict()`, `__dict__`) into plain data.

    Dicts, lists, strings, numbers, bools and None pass through (tuples become lists).
    Anything this cannot read is returned unchanged and later judged malformed.
    """
    if _depth > _MAX_DEPTH:
        return None
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_plain(v, _depth + 1) for v in obj]
    for method in ("model_dump", "to_dict"):
        fn = getattr(obj, method, None)
        if callable(fn):
            return to_plain(fn(), _depth + 1)
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        public = {k: v for k, v in attrs.items() if isinstance(k, str) and not k.startswith("_")}
        return to_plain(public, _depth + 1)
    return obj


@dataclass(slots=True)
class _Reply:
    """One reply read into its parts; `error`/`reason` hold the first problem found."""

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: object = None
    timings: object = None
    runtime: object = None
    model: str | None = None
    id: str | None = None
    complete: bool = True
    error: str | None = None
    reason: str | None = None

    def fail(self, error: str, reason: str) -> None:
        self.complete = False
        if self.error is None:
            self.error = error
            self.reason = reason


def _take_meta(reply: _Reply, frame: Mapping[str, object]) -> None:
    """Keep the last non-null usage, timings, runtime block, model and id of a frame."""
    if frame.get("usage") is not None:
        reply.usage = frame["usage"]
    if frame.get("timings") is not None:
        reply.timings = frame["timings"]
    if frame.get("tensorfold") is not None:
        reply.runtime = frame["tensorfold"]
    model, ident = frame.get("model"), frame.get("id")
    if isinstance(model, str):
        reply.model = model
    if isinstance(ident, str):
        reply.id = ident


def _take_piece(reply: _Reply, target: list[str], value: object, what: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        reply.fail("invalid_text_chunk", f"{what} is not a string")
        return
    if value:
        target.append(value)


def _take_choices(reply: _Reply, frame: Mapping[str, object], *, streamed: bool) -> None:
    choices = frame.get("choices")
    if choices is None:
        return
    if not isinstance(choices, list):
        reply.fail("malformed_response", "choices is not a list")
        return
    key = "delta" if streamed else "message"
    for choice in choices:
        if not isinstance(choice, dict):
            reply.fail("malformed_response", "a choice is not an object")
            continue
        index = choice.get("index", 0)
        if type(index) is int and index != 0:
            continue  # only the first choice is hashed; n > 1 is not how we call
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            reply.finish_reason = finish
        body = choice.get(key)
        if body is not None and not isinstance(body, dict):
            reply.fail("malformed_response", f"{key} is not an object")
            continue
        text = choice.get("text")
        content = body.get("content") if body is not None else None
        # Completions carry `text`, chat carries `content`; take the first non-empty one.
        _take_piece(reply, reply.content, text if text else content, f"{key}.content")
        if body is not None:
            reasoning = body.get("reasoning_content")
            _take_piece(reply, reply.reasoning, reasoning, f"{key}.reasoning_content")


def _read_chunks(chunks: Iterable[object], *, done: bool, malformed: str | None) -> _Reply:
    reply = _Reply()
    for frame in chunks:
        if not isinstance(frame, dict):
            reply.fail("malformed_stream", "a stream frame is not a JSON object")
            continue
        if frame.get("error") is not None:
            reply.fail("server_stream_error", "error frame")
            continue
        _take_meta(reply, frame)
        _take_choices(reply, frame, streamed=True)
    if malformed is not None:
        reply.fail("malformed_stream", malformed)
    if not done:
        reply.fail("incomplete_stream", "stream ended without [DONE]")
    return reply


def _read_response(resp: object) -> _Reply:
    reply = _Reply()
    if not isinstance(resp, dict):
        reply.fail("malformed_response", "the response is not a JSON object")
        return reply
    if resp.get("error") is not None:
        reply.fail("server_error", "error response")
        return reply
    _take_meta(reply, resp)
    if not isinstance(resp.get("choices"), list):
        reply.fail("malformed_response", "the response has no choices list")
    _take_choices(reply, resp, streamed=False)
    return reply


# --------------------------------------------------------------------------------------
# Judging


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


def _cached(usage: Mapping[str, object], timings: object) -> tuple[int | None, str | None, str]:
    """(cached, source, reason-if-None): the first present source decides."""
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
    return None, None, "cached_tokens missing (no prompt_tokens_details, no timings.cache_n)"


def _judge(reply: _Reply, *, wall_s: float | None, ttft_s: float | None) -> CallEvidence:
    usage_obj = reply.usage
    usage: Mapping[str, object] = usage_obj if isinstance(usage_obj, dict) else {}
    prompt = strict_count(usage.get("prompt_tokens"))
    completion = strict_count(usage.get("completion_tokens"))
    cached, source, cached_reason = _cached(usage, reply.timings)

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
        digest = output_digest(
            "".join(reply.content).encode("utf-8"), "".join(reply.reasoning).encode("utf-8")
        )
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
        error=reply.error,
        reason=reason,
    )


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
    frames = [to_plain(c) for c in chunks]
    return _judge(
        _read_chunks(frames, done=done, malformed=malformed), wall_s=wall_s, ttft_s=ttft_s
    )


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

    - a non-streamed response (dict or SDK object): complete when it is a JSON object with
      a `choices` list and no `error`;
    - a list of stream chunks (dicts or SDK objects): pass `done=True` only if the stream
      ended with `[DONE]` (an SDK stream iterated to its end did); anything else is
      treated as a truncated stream;
    - an `SSEStream` from `parse_sse`.
    """
    if isinstance(resp, SSEStream):
        return evidence_from_sse(resp, wall_s=wall_s, ttft_s=ttft_s)
    plain = to_plain(resp)
    if isinstance(plain, list):
        return evidence_from_chunks(plain, done=done is True, wall_s=wall_s, ttft_s=ttft_s)
    return _judge(_read_response(plain), wall_s=wall_s, ttft_s=ttft_s)


def assemble_reply(resp: object, *, done: bool | None = None) -> JSONObject:
    """A flat, response-like view of a reply: what a caller wants to read, not evidence.

    Keys: `content`, `reasoning` (None when empty), `finish_reason`, `usage`, `timings`,
    `model`, `id`. Takes the same inputs as `evidence_from_response`. Holds the output text,
    so it is for the caller, never for a record.
    """
    if isinstance(resp, SSEStream):
        reply = _read_chunks(resp.chunks, done=resp.done, malformed=resp.malformed)
    else:
        plain = to_plain(resp)
        if isinstance(plain, list):
            reply = _read_chunks(plain, done=done is True, malformed=None)
        else:
            reply = _read_response(plain)
    reasoning = "".join(reply.reasoning)
    return {
        "content": "".join(reply.content),
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


# --------------------------------------------------------------------------------------
# /cache counters


def counter_deltas(before: CacheCounters, after: CacheCounters) -> dict[str, int | None]:
    """after - before for every counter; None where either snapshot lacks the field.

    A negative delta on a cumulative counter means the server restarted in between.
    """
    out: dict[str, int | None] = {}
    for name in CACHE_COUNTER_FIELDS:
        b, a = getattr(before, name), getattr(after, name)
        out[name] = None if a is None or b is None else a - b
    return out


# Entries one prompt stores on the measured Halogen Flash lane (system end, history end).
MEASURED_ENTRIES_PER_REQUEST = 2


def lru_survival_stores(max_entries: int, per_request: int) -> int:
    """Stores a just-used prefix survives in an LRU of `max_entries`: its own `per_request`
    entries are the newest, so every older entry goes first."""
    return max(0, max_entries - per_request)


def is_interleaved(before: CacheCounters, after: CacheCounters, calls: int) -> bool:
    """True when the window cannot be attributed to our `calls` alone.

    That is: `hits + misses` moved by more than the calls made (foreign traffic), moved
    backwards (a restart), or cannot be read on either side (nothing to vouch with).
    """
    deltas = counter_deltas(before, after)
    hits, misses = deltas["hits"], deltas["misses"]
    if hits is None or misses is None or hits < 0 or misses < 0:
        return True
    return hits + misses > calls

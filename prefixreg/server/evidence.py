"""Evidence: what a server's reply proves about one call (DESIGN §4). Pure: no I/O.

One entry point, `evidence_from_response`, for whatever the caller holds: a response (a
dict, or an SDK object read by `model_dump()`, `to_dict()` or `__dict__`), stream chunks, a
raw SSE body (bytes or text), an `SSEStream`, a folded `ReplyReader` (the worker's path),
or an engine's native final reply (SGLang `/generate`, Ollama `/api/chat`: `_native`).
Anything else is a malformed response: unverified evidence, never an exception.

Invariants (DESIGN §4 as code):
- A count is valid only as an exact `int` >= 0 (`strict_count`); a missing count is never 0,
  but where the caller passes the engine's `zero_rule` (its rule, its flag known on).
- `cached_tokens` comes from the first valid of `usage.prompt_tokens_details.cached_tokens`
  and `timings.cache_n` (DESIGN §4), and `cached_source` names which. A source present but
  malformed (8.0, "8", true, -1, a list) is passed over; with no valid source the call is
  unverified, and its reason names the first malformed one.
- Disk tier: tokens restored from the server's disk (`timings.disk_restore_n`) were not
  prefilled: resumed tokens. When they exceed the cached count read above (or it is
  missing) they are the cached count, as `cached_source` says; the two are never added
  (whether `cache_n` counts disk restores is undocumented; the larger is a lower bound).
- `cold` = complete, valid counts, cached == 0; `reused` = complete, 0 < cached <= prompt;
  else `unverified`, `reason` in words. Completeness is `ReplyReader`'s rule (a finished
  stream or a final response, never one mid-stream chunk); an incomplete call has no
  `output_sha256`, `token_sha` or `ttft_s`.
- `error` is a short code of ours; neither the server's error text nor the output text is
  kept: only `output_sha256` = sha256(sha256(content) || sha256(reasoning)) over the UTF-8
  bytes of the joined pieces, whatever the chunk boundaries.
- `token_sha` is read only from `tensorfold.token_sha`, as 12 or 64 lowercase hex digits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Final

from prefixreg.core.digest import output_digest
from prefixreg.core.errors import UsageError
from prefixreg.core.fields import strict_number
from prefixreg.core.records import CacheState, CallEvidence, strict_count
from prefixreg.server.replies import ReplyReader, to_plain
from prefixreg.server.sse import SSEStream, parse_sse

SOURCE_USAGE: Final = "usage.prompt_tokens_details.cached_tokens"
SOURCE_TIMINGS: Final = "timings.cache_n"
SOURCE_DISK: Final = "timings.disk_restore_n"
SOURCE_SGLANG: Final = "meta_info.cached_tokens"
SOURCE_OLLAMA: Final = "prompt_eval_cached_count"

_TOKEN_SHA: Final = re.compile(r"[0-9a-f]{12}|[0-9a-f]{64}")
_MISSING: Final = "cached_tokens missing (no prompt_tokens_details, no timings.cache_n)"
_KINDS: Final = ((bool, "a boolean"), (int, "negative"), (float, "a float"), (str, "a string"))


def _why_invalid(name: str, value: object) -> str:
    if value is None:
        return f"{name} missing"
    kinds = (*_KINDS, (list, "a list"), (dict, "an object"))
    kind = next((words for t, words in kinds if isinstance(value, t)), None)
    return f"{name} is {kind or 'a ' + type(value).__name__}"


def _reported(usage: Mapping[str, object], timings: object) -> tuple[int | None, str | None, str]:
    """(cached, source, reason-if-None) from usage or cache_n: the first valid one wins
    (DESIGN §4); with none valid, the reason names the first that was sent malformed."""
    details = usage.get("prompt_tokens_details")
    why = ""
    for holder, holder_name, key, source in (
        (details, "prompt_tokens_details", "cached_tokens", SOURCE_USAGE),
        (timings, "timings", "cache_n", SOURCE_TIMINGS),
    ):
        if holder is not None and not isinstance(holder, dict):
            why = why or _why_invalid(holder_name, holder)
            continue
        raw = holder.get(key) if isinstance(holder, dict) else None
        if raw is None:
            continue
        count = strict_count(raw)
        if count is None:  # named as in usage ("cached_tokens") or in full (timings.cache_n)
            why = why or _why_invalid(key if source == SOURCE_USAGE else source, raw)
            continue
        return count, source, ""
    return None, None, why or _MISSING


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
        return None, None, _why_invalid(SOURCE_DISK, raw), None
    if cached is None and reason != _MISSING:
        return None, None, reason, restored  # a malformed source is not papered over
    if restored > 0 and (cached is None or restored > cached):
        return restored, SOURCE_DISK, "", restored
    return cached, source, reason, restored


def _judge(
    reply: ReplyReader, *, wall_s: float | None, ttft_s: float | None, zero_rule: str | None
) -> CallEvidence:
    usage_obj = reply.usage
    usage: Mapping[str, object] = usage_obj if isinstance(usage_obj, dict) else {}
    prompt = strict_count(usage.get("prompt_tokens"))
    cached, source, cached_reason, restored = _cached(usage, reply.timings)
    details = usage.get("prompt_tokens_details")  # null or absent in a usage sent, never `{}`
    if cached is None and cached_reason == _MISSING and zero_rule and details is None and usage:
        cached, source = 0, str(zero_rule)
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
    sha = reply.runtime.get("token_sha") if isinstance(reply.runtime, dict) else None
    token_sha = sha if isinstance(sha, str) and _TOKEN_SHA.fullmatch(sha) else None
    complete = reply.complete
    digest = output_digest(bytes(reply.content), bytes(reply.reasoning)) if complete else None
    return CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=strict_count(usage.get("completion_tokens")),
        cached_source=source,
        cache_state=state,
        complete=complete,
        output_sha256=digest,
        token_sha=token_sha if complete else None,
        ttft_s=ttft_s if complete else None,
        wall_s=wall_s,
        prompt_ms=strict_number(timings.get("prompt_ms")),
        predicted_ms=strict_number(timings.get("predicted_ms")),
        disk_restore_tokens=restored,
        disk_restore_ms=strict_number(timings.get("disk_restore_ms")),
        error=reply.error,
        reason=reason,
    )


def _native(plain: dict[str, Any]) -> tuple[dict[str, object], str] | None:
    """An engine's native final reply as the response it stands for, and its count's name:
    SGLang `/generate` (`meta_info.cached_tokens` always sent) or Ollama `/api/chat`
    (`prompt_eval_count` includes the cached; `prompt_eval_cached_count` from v0.33.3, absent
    before: unverified). Values pass unread (evidence reads them strictly); not `done`: no
    finish reason, so incomplete."""
    meta = plain.get("meta_info")
    if isinstance(meta, dict):
        finish = meta.get("finish_reason")
        names = ("prompt_tokens", "completion_tokens", "cached_tokens", SOURCE_SGLANG)
        choice = {"index": 0, "text": plain.get("text")}
        choice["finish_reason"] = finish.get("type") if isinstance(finish, dict) else None
    elif "prompt_eval_count" in plain and isinstance(plain.get("message"), dict):
        meta = plain
        names = ("prompt_eval_count", "eval_count", "prompt_eval_cached_count", SOURCE_OLLAMA)
        done = plain.get("done") is True
        choice = {"index": 0, "message": plain["message"], "finish_reason": None}
        choice["finish_reason"] = plain.get("done_reason", "stop") if done else None
    else:
        return None
    prompt, completion, cached, source = names
    usage = {"prompt_tokens": meta.get(prompt), "completion_tokens": meta.get(completion)}
    usage["prompt_tokens_details"] = {"cached_tokens": meta[cached]} if cached in meta else None
    return {"choices": [choice], "usage": usage}, source


def _read(resp: object, done: object) -> ReplyReader:
    """Fold any input `evidence_from_response` takes into a `ReplyReader`."""
    if done is not None and not isinstance(done, bool):
        raise UsageError(f"done is True, False or None, not {type(done).__name__}")
    if isinstance(resp, ReplyReader):
        return resp
    if isinstance(resp, bytes | bytearray | str):
        resp = parse_sse(resp)
    reply = ReplyReader()
    if isinstance(resp, SSEStream):
        chunks, done, malformed = resp.chunks, resp.done, resp.malformed
    else:
        plain = to_plain(resp)
        if not isinstance(plain, list):
            reply.take_response(plain)
            return reply
        chunks, malformed = plain, None
    for frame in chunks:
        reply.take_frame(frame)
    reply.end_stream(done=done is True, malformed=malformed)
    return reply


def _seconds(name: str, value: object) -> float | None:
    """A caller's `wall_s` or `ttft_s`: None, or a finite number of seconds >= 0."""
    number = strict_number(value)
    if value is not None and number is None:
        raise UsageError(f"{name} is None or a finite number of seconds >= 0")
    return number


def evidence_from_response(
    resp: object,
    *,
    done: bool | None = None,
    wall_s: float | None = None,
    ttft_s: float | None = None,
    zero_rule: str | None = None,
) -> CallEvidence:
    """Evidence from what a call returned (any input the module docstring names). One chunk is
    never complete, never `cold`; a list of chunks is complete only with `done=True` (ended
    with `[DONE]`, as an SDK stream iterated to its end). `zero_rule` (`engines.zero_rule`:
    the engine's rule, its flag known on) reads a null or absent `prompt_tokens_details` as
    0, and is then the `cached_source`.

    Raises UsageError: `done` is not a bool or None, `zero_rule` not a str or None, or
    `wall_s`/`ttft_s` not None or a finite number of seconds >= 0. Nothing in `resp` raises:
    what cannot be read is unverified evidence that says why."""
    wall, ttft = _seconds("wall_s", wall_s), _seconds("ttft_s", ttft_s)
    if zero_rule is not None and not isinstance(zero_rule, str):
        raise UsageError(f"zero_rule is a str or None, not {type(zero_rule).__name__}")
    native = _native(resp) if isinstance(resp, dict) else None
    if native is not None:  # the engine's own route: no rule but its own applies
        ev = _judge(_read(native[0], done), wall_s=wall, ttft_s=ttft, zero_rule=None)
        return replace(ev, cached_source=native[1] if ev.cached_source else None)
    return _judge(_read(resp, done), wall_s=wall, ttft_s=ttft, zero_rule=zero_rule)

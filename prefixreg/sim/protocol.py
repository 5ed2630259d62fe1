"""Halogen's request validation and response shapes, as pure functions (no I/O, no clock).

Field names follow halogen-api.md §1 exactly:

- errors: ``{"error": {"message", "type", "param": null, "code"}}``; ``type`` by status,
  ``code`` is ``"engine_busy"`` for 503 and null otherwise; validation errors are 400, never 422;
- usage: ``{prompt_tokens, completion_tokens, total_tokens}`` plus
  ``prompt_tokens_details: {cached_tokens}`` **only when cached > 0**;
- flash ``timings`` (``prompt_n``, ``predicted_n``, ``prompt_ms``, ``predicted_ms``,
  ``prompt_per_second``, ``predicted_per_second``, ``cache_n``, ``draft_n``, ``draft_n_accepted``)
  sit beside ``usage`` and ``cache_n`` is always present; dense has no ``timings``;
- streams: content frames, a finish frame (empty delta / text, ``finish_reason``, and flash
  ``timings``), then with ``stream_options.include_usage`` a ``choices: []`` frame carrying
  ``usage`` (every earlier frame then has ``"usage": null``), then ``data: [DONE]``.

Validation happens here, before a request is queued, as on the real server; the documented
400s for particular fields (logprobs, penalties, drafters, template kwargs) are in `fields`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from prefixreg.sim import fields
from prefixreg.sim.config import SimConfig
from prefixreg.sim.errors import ApiError
from prefixreg.sim.render import ToolsError, with_tools
from prefixreg.sim.tokenizer import RenderedPrompt, render_chat, render_completion

__all__ = [
    "TOKEN_BUDGET_ALIASES",
    "ApiError",
    "Call",
    "Result",
    "error_body",
    "parse_request",
    "response_body",
    "sse",
    "stream_frames",
]

Kind = Literal["chat", "completion"]
TOKEN_BUDGET_ALIASES = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS_DEFAULT = {"chat": 8192, "completion": 128}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope Halogen uses."""
    if code is None and status == 503:
        code = "engine_busy"
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "server_error"),
            "param": None,
            "code": code,
        }
    }


@dataclass(frozen=True, slots=True)
class Call:
    """A validated request, ready to queue."""

    kind: Kind
    prompt: RenderedPrompt
    max_tokens: int
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class Result:
    """What the engine did for one call, in real (speed-scaled) seconds."""

    call: Call
    id: str
    created: int
    model: str
    pieces: tuple[str, ...]
    finish_reason: str
    cached: int
    prompt_s: float
    decode_s: float
    disk_tier: bool = False  # report `disk_restore_n` / `disk_restore_ms` in timings
    disk_n: int = 0
    disk_s: float = 0.0


def _invalid(loc: str, msg: str) -> ApiError:
    return ApiError(400, f"{loc}: {msg}")


def _is_int(value: object) -> bool:
    return type(value) is int


def _is_number(value: object) -> bool:
    return type(value) in (int, float)


def _content_text(content: object, loc: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise _invalid(f"{loc}.{i}", "only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{loc}.{i}.text", "must be a string")
            parts.append(text)
        return "".join(parts)
    raise _invalid(loc, "must be a string, a list of text parts, or null")


def _messages(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("body.messages", "must be a non-empty list")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid(f"body.messages.{i}", "must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _invalid(f"body.messages.{i}.role", f"must be one of {sorted(ROLES)}")
        out.append((role, _content_text(message.get("content"), f"body.messages.{i}.content")))
    return out


def _token_budget(body: Mapping[str, Any], kind: Kind, config: SimConfig) -> int:
    sent = {name: body[name] for name in TOKEN_BUDGET_ALIASES if body.get(name) is not None}
    for name, value in sent.items():
        if not _is_int(value) or value < 1:
            raise _invalid(f"body.{name}", "must be an integer >= 1")
    if len(set(sent.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in sent.items())
        raise _invalid(
            "body",
            f"conflicting token budgets ({listed}); they are the same budget under three "
            "names, send one",
        )
    value = int(next(iter(sent.values()))) if sent else MAX_TOKENS_DEFAULT[kind]
    if value > config.max_tokens_cap:
        raise ApiError(
            400,
            f"max_tokens {value} exceeds this server's cap of {config.max_tokens_cap}. The cap "
            "is server policy, not a model limit: ask for fewer tokens or raise the server's "
            "--max-tokens-cap.",
        )
    return value


def _sampling(body: Mapping[str, Any]) -> None:
    for name, (low, high) in _RANGES.items():
        value = body.get(name)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            raise _invalid(f"body.{name}", f"must be a number in {low}..{high}")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _invalid("body.top_k", "must be an integer >= 0")


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _invalid("body.stream", "must be a boolean")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid("body.stream_options", "must be an object")
        flag = options.get("include_usage", False)
        if not isinstance(flag, bool):
            raise _invalid("body.stream_options.include_usage", "must be a boolean")
        include_usage = flag
    return stream, include_usage


def parse_request(raw: bytes, kind: Kind, config: SimConfig) -> Call:
    """Validate a POST body for `kind` and tokenize its prompt; `ApiError` (400) if invalid."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _invalid("body", "not valid JSON") from None
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    if kind == "chat":
        try:  # tools render into the system turn (sim/render.py)
            prompt = render_chat(with_tools(body, _messages(body)))
        except ToolsError as exc:
            raise _invalid(exc.loc, exc.msg) from None
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise _invalid("body.prompt", "must be a string")
        prompt = render_completion(text)
    max_tokens = _token_budget(body, kind, config)
    _sampling(body)
    stream, include_usage = _stream_flags(body)
    fields.check_sampled_only(body, stream)
    fields.check_drafter(body, config.profile)
    fields.check_template_kwargs(body, config.profile)
    if prompt.n >= config.slot_ctx:
        raise ApiError(
            400,
            f"the engine refused this request: prompt is {prompt.n} tokens and a slot holds "
            f"{config.slot_ctx} (prompt longer than a slot?)",
        )
    # Like dense, silently lower the budget to the room left in the slot.
    max_tokens = min(max_tokens, config.slot_ctx - prompt.n)
    return Call(kind, prompt, max_tokens, stream, include_usage)


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
    prompt_n = result.call.prompt.n - result.cached
    predicted_n = len(result.pieces)
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
    if result.disk_tier:
        body["disk_restore_n"] = result.disk_n
        body["disk_restore_ms"] = round(result.disk_s * 1000, 3)
    return body


def _object(kind: Kind, *, chunk: bool) -> str:
    if kind == "completion":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def response_body(result: Result, *, with_timings: bool) -> dict[str, Any]:
    """The non-streaming reply."""
    text = "".join(result.pieces)
    choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason}
    if result.call.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body: dict[str, Any] = {
        "id": result.id,
        "created": result.created,
        "model": result.model,
        "object": _object(result.call.kind, chunk=False),
        "choices": [choice],
        "usage": usage(result),
    }
    if with_timings:
        body["timings"] = timings(result)
    return body


def _frame(result: Result, choices: list[dict[str, Any]]) -> dict[str, Any]:
    frame: dict[str, Any] = {
        "id": result.id,
        "created": result.created,
        "model": result.model,
        "object": _object(result.call.kind, chunk=True),
        "choices": choices,
    }
    if result.call.include_usage:
        frame["usage"] = None
    return frame


def content_frame(result: Result, piece: str) -> dict[str, Any]:
    """One streamed piece of the answer."""
    if result.call.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "delta": {"content": piece}}
    else:
        choice = {"index": 0, "finish_reason": None, "text": piece}
    return _frame(result, [choice])


def final_frames(result: Result, *, with_timings: bool) -> list[dict[str, Any]]:
    """The finish frame (with flash `timings`) and, if asked for, the usage frame."""
    if result.call.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "delta": {}}
    else:
        choice = {"index": 0, "finish_reason": result.finish_reason, "text": ""}
    finish = _frame(result, [choice])
    if with_timings:
        finish["timings"] = timings(result)
    frames = [finish]
    if result.call.include_usage:
        usage_frame = _frame(result, [])
        usage_frame["usage"] = usage(result)
        frames.append(usage_frame)
    return frames


def stream_frames(result: Result, *, with_timings: bool) -> list[dict[str, Any]]:
    """Every data frame of a stream, in order (content, finish, usage); not `[DONE]`."""
    frames = [content_frame(result, piece) for piece in result.pieces]
    return frames + final_frames(result, with_timings=with_timings)


def sse(payload: Mapping[str, Any] | str) -> bytes:
    """One SSE `data:` frame; a str payload is sent as is (`[DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


KEEPALIVE = b": keepalive\n\n"

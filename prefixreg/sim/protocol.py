"""Halogen's wire protocol, pure, with halogen-api.md §1's field names: a POST body becomes a `Call`
or an `ApiError` (before queueing), a served call a `Result`, a `Result` its reply.

Errors are 400 (never 422), ``"<loc>: <msg>"``; besides field shapes, the documented 400s (§1.5):
``top_logprobs``; ``logprobs`` with ``stream``; ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` or ``logprobs`` unless ``temperature`` > 0 (absent is 0); a ``drafter`` the profile
lacks; on Flash, a ``chat_template_kwargs`` key not in ``CHAT_TEMPLATE_KWARGS`` or contradicting its
top-level field. Tools render Qwen-style at the end of the system turn (a snapshot at `system_end`
covers them; one is opened if there is none); ``tool_choice: "none"`` renders none (alternating it
with "auto" costs a miss); `tool_calls` follow their turn's content. Replies: errors ``{"error":
{"message", "type", "param": null, "code"}}``; usage with ``prompt_tokens_details: {cached_tokens}``
only when cached > 0; Flash ``timings`` beside it (``cache_n`` always), dense none. Streams: content
frames, a finish frame (empty delta / text, Flash ``timings``), with ``include_usage`` a ``choices:
[]`` frame carrying ``usage`` (earlier frames ``"usage": null``), ``data: [DONE]``. With
`config.engine`: that engine's usage and fields, no ``timings`` (`sim.engines`); its native
routes (`NATIVE`) read as the shared request and answered in the engine's own reply shape.
With `cached_differs` a reply that resumed cached tokens ends with other bytes than the cold one.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from prefixreg.core import jsonio
from prefixreg.core.errors import CorruptRecordError
from prefixreg.sim import engines
from prefixreg.sim.config import SimConfig
from prefixreg.sim.tokenizer import RenderedPrompt, answer_tokens, render_chat, render_completion

Kind = Literal["chat", "completion"]
TOKEN_BUDGET_ALIASES = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS_DEFAULT = {"chat": 8192, "completion": 128}
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
DRAFTERS = {"flash": ("serial", "mtp"), "dense": ("serial", "mtp", "dflash2", "ngram")}
# The template switches Flash accepts in `chat_template_kwargs` (0.5.7: three keys) [inferred
# names: the template's own switches among the documented request fields].
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "preserve_thinking", "reasoning_effort"})
TOOLS_HEADER = "\n\n# Tools\n\nYou may call one or more of these functions:\n<tools>\n"
TOOL_CHOICES = ("auto", "none", "required")  # a tuple: `in` must take a list too
_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class ApiError(Exception):
    """An HTTP error the simulator answers with the OpenAI envelope."""

    def __init__(self, status: int, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    def body(self) -> dict[str, Any]:
        kind = _ERROR_TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.code}}


def invalid(loc: str, msg: str) -> ApiError:
    """A 400 validation error at `loc`."""
    return ApiError(400, f"{loc}: {msg}")


@dataclass(frozen=True, slots=True)
class Call:
    """A validated request, ready to queue."""

    kind: Kind
    prompt: RenderedPrompt
    max_tokens: int
    stream: bool
    include_usage: bool


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _content_text(content: object, loc: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise invalid(loc, "must be a string, a list of text parts, or null")
    for i, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            raise invalid(f"{loc}.{i}", "only text content parts are supported")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{loc}.{i}.text", "must be a string")
    return "".join(part["text"] for part in content)


def _messages(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The (role, content) pairs to render, tool calls and tools placed (module docstring)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("body.messages", "must be a non-empty list")
    out: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        loc = f"body.messages.{i}"
        if not isinstance(message, dict):
            raise invalid(loc, "must be an object")
        role, calls = message.get("role"), message.get("tool_calls")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{loc}.role", f"must be one of {sorted(ROLES)}")
        content = _content_text(message.get("content"), f"{loc}.content")
        if calls is not None and not isinstance(calls, list):
            raise invalid(f"{loc}.tool_calls", "must be a list")
        content += "".join(f"\n<tool_call>\n{_compact(c)}\n</tool_call>" for c in calls or ())
        out.append((role, content))
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not (choice is None or isinstance(choice, dict) or choice in TOOL_CHOICES):
        raise invalid("body.tool_choice", f"must be one of {list(TOOL_CHOICES)} or an object")
    if not (tools is None or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools))):
        raise invalid("body.tools", "must be a list of objects")
    if not tools or choice == "none":
        return out
    block = TOOLS_HEADER + "\n".join(_compact(t) for t in tools) + "\n</tools>"
    if out[0][0] in ("system", "developer"):
        out[0] = (out[0][0], out[0][1] + block)
    else:
        out.insert(0, ("system", block.lstrip("\n")))
    return out


def _token_budget(body: Mapping[str, Any], kind: Kind, config: SimConfig) -> int:
    sent = {name: body[name] for name in TOKEN_BUDGET_ALIASES if body.get(name) is not None}
    for name, value in sent.items():
        if type(value) is not int or value < 1:
            raise invalid(f"body.{name}", "must be an integer >= 1")
    if len(set(sent.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in sent.items())
        why = "they are the same budget under three names, send one"
        raise invalid("body", f"conflicting token budgets ({listed}); {why}")
    value = int(next(iter(sent.values()))) if sent else MAX_TOKENS_DEFAULT[kind]
    if value > config.max_tokens_cap:
        cap = config.max_tokens_cap
        policy = "The cap is server policy, not a model limit: ask for fewer tokens or raise"
        policy += " the server's --max-tokens-cap."
        raise ApiError(400, f"max_tokens {value} exceeds this server's cap of {cap}. {policy}")
    return value


def _options(body: Mapping[str, Any], profile: str) -> tuple[bool, bool]:
    """(stream, include_usage), after the server's checks in its order (module docstring)."""
    for name, (low, high) in _RANGES.items():
        value = body.get(name)
        if value is not None and (type(value) not in (int, float) or not low <= value <= high):
            raise invalid(f"body.{name}", f"must be a number in {low}..{high}")
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < 0):
        raise invalid("body.top_k", "must be an integer >= 0")
    stream = False if body.get("stream") is None else body["stream"]
    if not isinstance(stream, bool):
        raise invalid("body.stream", "must be a boolean")
    options = {} if body.get("stream_options") is None else body["stream_options"]
    if not isinstance(options, dict):
        raise invalid("body.stream_options", "must be an object")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("body.stream_options.include_usage", "must be a boolean")
    if body.get("top_logprobs") is not None:
        raise invalid("body.top_logprobs", "is not supported")
    logprobs = bool(body.get("logprobs"))
    if logprobs and stream:
        raise invalid("body.logprobs", "cannot be combined with stream")
    temperature = body.get("temperature") or 0
    if not (type(temperature) in (int, float) and temperature > 0):
        sampled_only = ("presence_penalty", "frequency_penalty", "logit_bias")
        for name in (*sampled_only, *(("logprobs",) if logprobs else ())):  # false is no option
            if body.get(name) is not None:
                msg = "needs temperature > 0 (decoding at temperature 0 is greedy)"
                raise invalid(f"body.{name}", msg)
    drafter, available = body.get("drafter"), DRAFTERS[profile]
    if drafter is not None and (not isinstance(drafter, str) or drafter not in available):
        raise invalid(
            "body.drafter",
            f"unknown or unavailable drafter {drafter!r}; available: {', '.join(available)}",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None or profile != "flash":
        return stream, include_usage
    if not isinstance(kwargs, dict):
        raise invalid("body.chat_template_kwargs", "must be an object")
    for key, value in kwargs.items():
        loc = f"body.chat_template_kwargs.{key}"
        if key not in CHAT_TEMPLATE_KWARGS:
            raise invalid(loc, f"unknown key; known: {', '.join(sorted(CHAT_TEMPLATE_KWARGS))}")
        top = body.get(key)
        if top is not None and top != value:
            raise invalid(loc, f"conflicts with the top-level {key} ({top!r} != {value!r})")
    return stream, include_usage


def _token_ids(value: object) -> bool:
    """A non-empty list of token IDs (ints 0..2**32-1, never booleans)."""
    listed = value if isinstance(value, list) else []
    return bool(listed) and all(type(t) is int and 0 <= t < 1 << 32 for t in listed)


def parse_request(raw: bytes, kind: Kind, config: SimConfig) -> Call:
    """Validate a POST body for `kind` and tokenize its prompt; `ApiError` (400) if invalid."""
    try:
        body = jsonio.loads(raw)  # depth-capped: no body can exhaust the stack
    except CorruptRecordError:
        raise invalid("body", "not valid JSON") from None
    if not isinstance(body, dict):
        raise invalid("body", "must be a JSON object")
    text = body.get("prompt")
    if kind == "chat":
        prompt = render_chat(_messages(body))
    elif isinstance(text, str):
        prompt = render_completion(text)
    elif config.engine in engines.TOKEN_PROMPTS and isinstance(text, list) and _token_ids(text):
        prompt = RenderedPrompt(tuple(f"<{t}>" for t in text), None, None)  # one token per ID
    else:
        what = "a string or a list of token IDs" if config.engine in engines.TOKEN_PROMPTS else ""
        raise invalid("body.prompt", f"must be {what or 'a string'}")
    max_tokens = _token_budget(body, kind, config)
    stream, include_usage = _options(body, config.profile)
    if prompt.n >= config.slot_ctx:
        held = f"prompt is {prompt.n} tokens and a slot holds {config.slot_ctx}"
        raise ApiError(400, f"the engine refused this request: {held} (prompt longer than a slot?)")
    # Like dense, silently lower the budget to the room left in the slot.
    return Call(kind, prompt, min(max_tokens, config.slot_ctx - prompt.n), stream, include_usage)


class Result:
    """A served call: answer, tokens resumed (``disk_n`` from disk), scaled durations, replies."""

    def __init__(self, config: SimConfig, call: Call, found: tuple[int, int, float]) -> None:
        self.config, self.call = config, call
        self.cached, self.disk_n, disk_s = found
        answer = answer_tokens(call.prompt, config.answer_tokens)
        self.pieces = tuple(answer[: call.max_tokens])
        if config.cached_differs and self.cached > 0:  # not bitwise the cold answer
            self.pieces = (*self.pieces[:-1], self.pieces[-1] + "!")
        self.finish_reason = "stop" if len(self.pieces) == len(answer) else "length"
        self.id = ("chatcmpl-" if call.kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.engine = config.engine
        if self.engine is not None and call.kind == "chat":
            self.id = engines.reply_id(self.engine)
        self.created = int(time.time())
        prefill_s = config.prefill_s(prompt=call.prompt.n, cached=self.cached)
        self.prompt_s = (prefill_s + disk_s) / config.speed
        self.decode_s = len(self.pieces) / config.decode_tps / config.speed
        self.disk_s = disk_s / config.speed

    def usage(self) -> dict[str, Any]:
        """The usage object; `prompt_tokens_details` only when something was cached."""
        n, k = self.call.prompt.n, len(self.pieces)
        if self.engine is not None:
            return engines.usage(self.engine, self.config.cache_report, n, k, self.cached)
        body: dict[str, Any] = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
        if self.cached > 0:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return body

    def timings(self) -> dict[str, Any]:
        """Flash `timings`: llama.cpp-style, `prompt_n` is what was actually prefilled."""
        prompt_n, predicted_n = self.call.prompt.n - self.cached, len(self.pieces)
        body: dict[str, Any] = {"prompt_n": prompt_n, "prompt_ms": round(self.prompt_s * 1000, 3)}
        body["prompt_per_second"] = round(prompt_n / self.prompt_s, 3) if self.prompt_s else 0.0
        body |= {"predicted_n": predicted_n, "predicted_ms": round(self.decode_s * 1000, 3)}
        body["predicted_per_second"] = (
            round(predicted_n / self.decode_s, 3) if self.decode_s else 0.0
        )
        body |= {"cache_n": self.cached, "draft_n": 0, "draft_n_accepted": 0}
        if self.config.cache_dir is not None:  # the disk tier is on
            body["disk_restore_n"] = self.disk_n
            body["disk_restore_ms"] = round(self.disk_s * 1000, 3)
        return body

    def reply(self, finish: str | None, text: str | None, *, chunk: bool) -> dict[str, Any]:
        """One choice: a message, a delta (`text` None: a stream's finish) or a completion text."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.call.kind == "completion":
            choice["text"] = text or ""
        elif chunk:
            choice["delta"] = {} if text is None else {"content": text}
        else:
            choice["message"] = {"role": "assistant", "content": text}
        chat = "chat.completion.chunk" if chunk else "chat.completion"
        kind = "text_completion" if self.call.kind == "completion" else chat
        body: dict[str, Any] = {"id": self.id, "created": self.created}
        body |= {"model": self.config.model_id, "object": kind, "choices": [choice]}
        if chunk and self.call.include_usage:
            body["usage"] = None
        return body if self.engine is None else engines.dress(self.engine, body)

    def response_body(self) -> dict[str, Any]:
        """The non-streaming reply."""
        body = self.reply(self.finish_reason, "".join(self.pieces), chunk=False)
        if self.engine is not None:  # usage before the engine's trailing fields
            return engines.dress(self.engine, body | {"usage": self.usage()})
        body["usage"] = self.usage()
        if self.config.flash:
            body["timings"] = self.timings()
        return body

    def final_frames(self) -> bytes:
        """The finish frame (with flash `timings`), the usage frame if asked for, and [DONE]."""
        finish = self.reply(self.finish_reason, None, chunk=True)
        if self.config.flash and self.engine is None:
            finish["timings"] = self.timings()
        frames = [sse(finish)]
        if self.call.include_usage:
            last = self.reply(None, None, chunk=True) | {"choices": [], "usage": self.usage()}
            frames.append(sse(last if self.engine is None else engines.dress(self.engine, last)))
        return b"".join(frames) + b"data: [DONE]\n\n"


def sse(payload: Mapping[str, Any]) -> bytes:
    """One SSE `data:` frame."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# (engine, path) of each native POST route: the kind of shared request it stands for.
NATIVE: Final[dict[tuple[str, str], Kind]] = {
    ("sglang", "/generate"): "completion",
    ("ollama", "/api/chat"): "chat",
}


def native_request(engine: str, raw: bytes) -> bytes:
    """A native body as the shared request (a body not a JSON object passes, to be refused)."""
    try:
        body = jsonio.loads(raw)
    except CorruptRecordError:
        return raw
    if not isinstance(body, dict):
        return raw
    name = "sampling_params" if engine == "sglang" else "options"
    params = {} if body.get(name) is None else body[name]
    if not isinstance(params, dict):
        raise invalid(f"body.{name}", "must be an object")
    if engine == "sglang":
        out: dict[str, Any] = {"prompt": body.get("text"), "stream": body.get("stream", False)}
        budget = params.get("max_new_tokens")
    else:
        if body.get("stream") is not False:
            raise invalid("body.stream", "the simulator serves /api/chat with stream false only")
        out = {"messages": body.get("messages"), "stream": False}
        budget = params.get("num_predict")
    if out["stream"] is not False:
        raise invalid("body.stream", "the simulator serves native routes non-streamed only")
    passed = {"max_tokens": budget, "temperature": params.get("temperature")}
    out |= {name: value for name, value in passed.items() if value is not None}
    return json.dumps(out).encode()


def native_reply(result: Result) -> dict[str, Any]:
    """The native reply of a served call: SGLang `/generate` or Ollama `/api/chat`."""
    engine, text = str(result.engine), "".join(result.pieces)
    n, k, cached = result.call.prompt.n, len(result.pieces), result.cached
    if engine == "sglang":
        finish = {"type": result.finish_reason, "length": k}
        meta: dict[str, Any] = {"id": secrets.token_hex(16), "finish_reason": finish}
        meta |= {"prompt_tokens": n, "weight_version": "default", "total_retractions": 0}
        meta |= {"completion_tokens": k, "cached_tokens": cached, "cached_tokens_details": None}
        meta |= {"dp_rank": None, "e2e_latency": round(result.prompt_s + result.decode_s, 4)}
        return {"text": text, "output_ids": list(range(k)), "meta_info": meta}
    model = result.config.model_id
    created = time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime(result.created))
    message = {"role": "assistant", "content": text}
    out: dict[str, Any] = {"model": model, "created_at": created, "message": message}
    out |= {"done": True, "done_reason": result.finish_reason, "prompt_eval_count": n}
    if result.config.cache_report:  # from 0.33.3
        out["prompt_eval_cached_count"] = cached
    return out | {"eval_count": k}

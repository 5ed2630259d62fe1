"""The client for one worker: /health, /cache, /props, /slots, /metrics, /v1/models, chat.

Server profiles, and what each can prove (detected in this order; `profile=` forces one):

    profile   detected by                           per-call evidence            /cache
    halogen   /health has prompt_cache or           usage (cached only when > 0)  yes
              cache_counters                        + timings.cache_n (Flash)
    llamacpp  /props answers with build_info        usage (explicit 0)            no
                                                    + timings.cache_n
    vllm      /version answers {"version": str}     usage.prompt_tokens_details,  no
                                                    only with the server's
                                                    --enable-prompt-tokens-details
    generic   anything else                         usage, if the server sends    no

Only halogen can prove counter-level facts (hits, misses, evictions); every profile can
prove per-call cold/reused when its usage carries the counts (DESIGN §4). A count the
server did not send is never read as zero. Build identities per profile: `server.identity`.

Invariants:

- Every call has a deadline that bounds it whole (connect to last byte, streams included)
  and every reply a size cap (`max_bytes`, default 64 MiB); see `server.transport`.
  `timeout` (default 10 s) is the deadline of each small-route call, `read_timeout`
  (default 1800 s, since a cold prefill can take minutes) that of each chat call; a small
  route never waits longer than `read_timeout` either. Both are checked at construction:
  finite, above 0, at most one day (`UsageError` otherwise).
- The build identity is read fresh on every `server_build()` call (DESIGN §3 rule 3).
- The API key (`api_key=`, else env `PREFIXREG_API_KEY`) is sent as `Authorization: Bearer`
  and nowhere else: not in `repr`, not in an exception message, not in a log line.
- A chat call that got a 200 never raises for what its body then says: an error frame, a
  truncated stream, a malformed line, or a non-streamed body that is not a final JSON
  response give evidence `unverified` with an `error` code, so the call can be recorded.
  Past the deadline or over the cap it raises (`WorkerTimeoutError`, `ReplyTooLargeError`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import orjson

from prefixreg.core.errors import MalformedResponseError, UsageError, WorkerHTTPError
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject, JSONValue, check_value
from prefixreg.core.prefix import Prefix, check_text
from prefixreg.core.records import CacheCounters, CallEvidence, ServerBuild
from prefixreg.server.counters import parse_prometheus
from prefixreg.server.evidence import ReplyReader, assemble_reply, evidence_from_reader
from prefixreg.server.identity import (
    generic_identity,
    halogen_identity,
    is_halogen,
    llamacpp_identity,
    vllm_identity,
)
from prefixreg.server.sse import SSEParser
from prefixreg.server.transport import (
    DEFAULT_MAX_BYTES,
    ReplyTooLargeError,
    Transport,
    check_max_bytes,
    check_seconds,
    display_url,
)

__all__ = ["API_KEY_ENV", "DEFAULT_MAX_BYTES", "PROFILES", "ReplyTooLargeError", "Worker"]

API_KEY_ENV: Final = "PREFIXREG_API_KEY"
PROFILES: Final = ("halogen", "llamacpp", "vllm", "generic")

_NO_ROUTE: Final = frozenset({404, 405, 501})
_NEVER: Final[frozenset[int]] = frozenset()


class Worker:
    """A client for one worker URL (the server root; a trailing `/v1` is dropped).

    Use as a context manager, or call `close()`. `profile` forces a server profile instead
    of detecting it; `model` is sent as the chat `model` unless a call passes its own;
    `max_bytes` caps every reply; `transport` is for tests (an `httpx` transport).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        read_timeout: float = 1800.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        profile: str | None = None,
        model: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not isinstance(url, str):
            raise UsageError(f"the worker URL must be a string, not {type(url).__name__}")
        base = url.strip().rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        try:
            parts = urlsplit(base)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            valid = valid and (parts.port is None or parts.port > 0)  # .port raises if bad
            shown = display_url(base)
        except ValueError:
            valid, shown = False, base.split("@")[-1]  # never echo user info (a password)
        if not valid:
            raise UsageError(f"not a worker URL (http://host:port): {shown!r}")
        if profile is not None and profile not in PROFILES:
            raise UsageError(f"unknown server profile {profile!r}; one of {', '.join(PROFILES)}")
        self.timeout = check_seconds("timeout", timeout)
        self.read_timeout = check_seconds("read_timeout", read_timeout)
        self.max_bytes = check_max_bytes(max_bytes)
        self.url = display_url(base)
        self.profile = profile
        self.model = model
        self._default_model: str | bool | None = False  # not read yet (see `default_model`)
        for what, value in (("api_key", api_key), ("model", model)):
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{what} must be a string, not {type(value).__name__}")
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        key = key.strip() if key else None
        if key and not all(" " < ch < "\x7f" for ch in key):
            raise UsageError(
                f"the API key (argument or {API_KEY_ENV}) must be printable ASCII without spaces"
            )
        self._key = key or None
        self._http = Transport(base, key=self._key, max_bytes=self.max_bytes, transport=transport)

    def __repr__(self) -> str:
        auth = "set" if self._key is not None else "none"
        return f"Worker({self.url!r}, profile={self.profile!r}, api_key={auth})"

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # ---------------------------------------------------------------- small routes

    @property
    def _small(self) -> float:
        return min(self.timeout, self.read_timeout)

    def _get(self, path: str, *, missing_ok: bool = False) -> JSONObject | None:
        missing = _NO_ROUTE if missing_ok else _NEVER
        return self._http.get_json(path, seconds=self._small, missing=missing)

    def post_json(
        self, path: str, body: JSONObject, *, seconds: float, missing: frozenset[int] = _NEVER
    ) -> JSONObject | None:
        """POST a JSON body to a small route (llama.cpp's slot actions) within `seconds` in
        all; the reply as a JSON object, or None when its status is in `missing`."""
        seconds = min(check_seconds("seconds", seconds), self.read_timeout)
        headers = {"Content-Type": "application/json"}
        with self._http.call(
            "POST", path, seconds=seconds, content=orjson.dumps(body), headers=headers
        ) as call:
            if call.status in missing:
                return None
            self._http.raise_for_status("POST", path, call)
            return self._http.json_object("POST", path, call.read(), call.content_type)

    def health(self) -> JSONObject:
        """GET /health, as the server sent it."""
        body = self._get("/health")
        assert body is not None  # noqa: S101 -- missing_ok is False
        return body

    def cache_raw(self) -> JSONObject | None:
        """GET /cache as sent; None when the server has no /cache (404, 405, 501)."""
        return self._get("/cache", missing_ok=True)

    def cache(self) -> CacheCounters | None:
        """GET /cache as strict counters; None when the server has no /cache."""
        raw = self.cache_raw()
        return None if raw is None else CacheCounters.from_server(raw)

    def models(self) -> JSONObject:
        """GET /v1/models, as the server sent it."""
        body = self._get("/v1/models")
        assert body is not None  # noqa: S101 -- missing_ok is False
        return body

    def props(self) -> JSONObject | None:
        """GET /props (llama.cpp); None when the server has no such route."""
        return self._get("/props", missing_ok=True)

    def template_tokens(self, body: Mapping[str, Any]) -> int | None:
        """llama.cpp: how many tokens the prompt its chat template renders for `body` has
        (`/apply-template`, then `/tokenize`); None when the server cannot say."""
        try:
            rendered = self.post_json(
                "/apply-template", dict(body), seconds=self._small, missing=_NO_ROUTE
            )
            prompt = None if rendered is None else rendered.get("prompt")
            if not isinstance(prompt, str):
                return None
            ask: JSONObject = {"content": prompt, "add_special": True, "parse_special": True}
            tokens = self.post_json("/tokenize", ask, seconds=self._small, missing=_NO_ROUTE)
        except (WorkerHTTPError, MalformedResponseError):
            return None
        found = None if tokens is None else tokens.get("tokens")
        return len(found) if isinstance(found, list) else None

    def version(self) -> JSONObject | None:
        """GET /version (vLLM); None when the server has no such route."""
        return self._get("/version", missing_ok=True)

    def _get_body(self, path: str) -> bytes | None:
        """GET `path` as raw bytes; None when the route is missing (404, 405, 501)."""
        got = self._http.get(path, seconds=self._small, missing=_NO_ROUTE)
        return None if got is None else got[0]

    def slots(self) -> list[JSONObject] | None:
        """GET /slots (llama.cpp): one object per slot; None when the route is off.

        llama.cpp answers 501 when started with `--no-slots`. A slot that has served a task
        carries `id_task`, which changes with every completion the slot serves (and only
        then: `/slots`, `/metrics`, `/props` and `/tokenize` do not touch it).
        """
        raw = self._get_body("/slots")
        if raw is None:
            return None
        try:
            body: JSONValue = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, list):
            raise MalformedResponseError(
                f"{self._http.where('GET', '/slots')}: the reply is not a JSON list", url=self.url
            )
        return [s for s in body if isinstance(s, dict)]

    def metrics(self) -> dict[str, float] | None:
        """GET /metrics (Prometheus text): samples by name; None when the route is off.

        llama.cpp serves it only with `--metrics` (501 otherwise). A sample's labels stay
        part of its name; comment lines and unparsable values are skipped.
        """
        raw = self._get_body("/metrics")
        if raw is None:
            return None
        return parse_prometheus(raw)

    # ---------------------------------------------------------------- profile + build

    def _health_or_none(self) -> JSONObject | None:
        """/health, or None when the server has no such route or answers it with non-JSON.

        A server error (503 while loading, `engine_unresponsive`), a timeout or an oversized
        reply raises: guessing a profile from a sick server would bind measurements to the
        wrong identity.
        """
        try:
            return self._get("/health", missing_ok=True)
        except MalformedResponseError:
            return None

    def _probe(self, read: Callable[[], JSONObject | None]) -> JSONObject | None:
        """A detection read: a route that errors or is not JSON simply does not match."""
        try:
            return read()
        except (WorkerHTTPError, MalformedResponseError):
            return None

    def _detect(self) -> tuple[str, JSONObject | None, JSONObject | None]:
        """(profile, /health body, /props or /version body): each read at most once."""
        health = self._health_or_none()
        if self.profile is not None:
            return self.profile, health, None
        if is_halogen(health):
            return "halogen", health, None
        props = self._probe(self.props)
        if props is not None and "build_info" in props:
            return "llamacpp", health, props
        version = self._probe(self.version)
        if version is not None and isinstance(version.get("version"), str):
            return "vllm", health, version
        return "generic", health, None

    def detect_profile(self) -> str:
        """One of `PROFILES` (the forced `profile=` if one was given)."""
        return self._detect()[0]

    def server_build(self) -> ServerBuild:
        """The identity of the server right now (DESIGN §4), read fresh on every call."""
        profile, health, body = self._detect()
        if profile == "halogen":
            return ServerBuild(profile=profile, identity=halogen_identity(health or self.health()))
        if profile == "llamacpp":
            if body is None:
                body = self.props()
            return ServerBuild(profile=profile, identity=llamacpp_identity(body or {}))
        models = self._get("/v1/models", missing_ok=True)
        if profile == "vllm":
            if body is None:
                body = self._probe(self.version)
            return ServerBuild(profile=profile, identity=vllm_identity(body, models))
        return ServerBuild(profile=profile, identity=generic_identity(models))

    def default_model(self) -> str | None:
        """The model a chat sends when neither the call nor `model=` names one: the first id
        of `/v1/models` (vLLM, SGLang and most OpenAI-compatible servers need one), read
        once per client and kept; None when the server lists none."""
        if self._default_model is False:
            try:
                models = self._get("/v1/models", missing_ok=True)
            except (WorkerHTTPError, MalformedResponseError):
                models = None
            ids = generic_identity(models).get("model_ids")
            first = ids[0] if isinstance(ids, list) and ids else None
            self._default_model = first if isinstance(first, str) else None
        return self._default_model if isinstance(self._default_model, str) else None

    # ---------------------------------------------------------------- chat

    def chat(
        self,
        prefix: Prefix | Frame | str,
        tail: str | None = None,
        *,
        history: Sequence[Mapping[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        stream: bool = True,
        headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> tuple[JSONObject, CallEvidence]:
        """One chat call: `messages = prefix.messages(tail)` plus `params` (max_tokens, ...).

        `history` (a list of OpenAI-shaped messages: turns, tool calls, tool results) replaces
        the one-line `tail`; `tools` adds tool definitions. A `Frame` sends its verified
        system bytes, tools and settings (`Frame.body`). Returns the reply (`content`,
        `reasoning`, `finish_reason`, `usage`, `timings`, `model`, `id`; see
        `evidence.assemble_reply`) and the call's evidence. Streams ask for
        `stream_options.include_usage`; `headers` are sent with this call only (a router's
        routing key, `x-smg-routing-key`). HTTP errors, the deadline and the reply cap
        raise; what a 200 body says does not (see the module invariants). A plain `str`
        prefix is sent as the system message as is: nothing verifies it.
        """
        for reserved in ("messages", "stream"):
            if reserved in params:
                raise UsageError(f"chat() sets {reserved!r} itself; do not pass it")
        turns = _turns(tail, history)
        if not isinstance(prefix, Prefix | Frame | str):
            raise UsageError(
                f"chat() sends a Prefix, a Frame or a str, not {type(prefix).__name__}"
            )
        if isinstance(prefix, Frame):
            if tools is not None:
                params["tools"] = tools  # Frame.body refuses tools other than the frame's
            frame_body = prefix.body(turns, **params)
            messages = frame_body.pop("messages")
            params = frame_body
        else:
            text = prefix.text if isinstance(prefix, Prefix) else prefix
            messages = [{"role": "system", "content": text}, *turns]
            if tools is not None:
                params["tools"] = tools
        body: dict[str, Any] = {}
        model = params.get("model") or self.model or self.default_model()
        if model is not None:
            body["model"] = model
        body.update(params)
        body["messages"] = messages
        body["stream"] = stream
        if stream:
            options = params.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {})}
            body["stream_options"]["include_usage"] = True
        _check_body(body)
        return self._post_chat("/v1/chat/completions", body, stream=stream, extra=headers)

    def _post_chat(
        self,
        path: str,
        body: dict[str, Any],
        *,
        stream: bool,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[JSONObject, CallEvidence]:
        headers = {**(extra or {}), "Content-Type": "application/json"}
        if stream:
            headers["Accept"] = "text/event-stream"
        reply = ReplyReader()
        first: float | None = None
        started = time.perf_counter()
        with self._http.call(
            "POST", path, seconds=self.read_timeout, content=orjson.dumps(body), headers=headers
        ) as call:
            self._http.raise_for_status("POST", path, call)
            if stream and call.content_type.startswith("text/event-stream"):
                parser = SSEParser(keep=False)  # frames are folded as they come, not kept
                for piece in call.pieces(drop_ok=True):
                    for frame in parser.feed(piece):
                        if reply.take_frame(frame) and first is None:
                            first = time.perf_counter()
                    if parser.stream.done:
                        break
                ended = parser.finish()
                reply.end_stream(done=ended.done, malformed=ended.malformed)
            else:
                # A body cut short reads as not JSON: unverified, as a truncated stream.
                raw = b"".join(call.pieces(drop_ok=True))
                try:
                    data: object = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    reply.fail("malformed_response", "the reply is not JSON")
                else:
                    reply.take_response(data)
        wall = time.perf_counter() - started
        ttft = None if first is None else first - started
        return assemble_reply(reply), evidence_from_reader(reply, wall_s=wall, ttft_s=ttft)


def _turns(tail: str | None, history: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages after the system one: the one-line `tail`, or a copy of `history`."""
    if (tail is None) == (history is None):
        raise UsageError("chat() takes a tail or a history, exactly one of them")
    if history is None:
        return [{"role": "user", "content": check_text(tail, "the tail")}]
    given: object = history  # callers outside the type checker pass anything
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise UsageError("history must be a list of message objects")
    items: Sequence[object] = given
    for i, message in enumerate(items):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UsageError(f"history[{i}] must be a message object with a string 'role'")
    return [dict(m) for m in history]


def _check_body(body: Mapping[str, Any]) -> None:
    """A request body travels as JSON by the project's rules (finite numbers, 64-bit
    integers, UTF-8 text, depth 64): anything else is the caller's error, before a byte is
    sent."""
    try:
        check_value(dict(body))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"chat(): the request is not JSON the server can read: {exc}") from None

"""The client for one worker: /health, /cache, /props, /slots, /metrics, /v1/models, chat,
completions.

Profiles are detected in this order from what the server answers (never its port) unless
`profile=` forces one: halogen (/health names its prompt cache), llamacpp (/props has
`build_info`), sglang (/server_info), trtllm or vllm (the /v1/models owner), ollama
(/api/version), vllm (/version answers a version string), generic (`server.engines`).

Invariants:
- Every call has a deadline bounding it whole and every reply a size cap (`max_bytes`, 64 MiB
  by default; `server.transport`): `timeout` (10 s) per small route, `read_timeout` (1800 s:
  a cold prefill can take minutes) per chat call and at most per small route too.
- Every argument is checked before a byte is sent; a wrong type or value is a `UsageError`
  (a timeout must be finite, above 0 and at most one day).
- No state is kept between calls: the build identity is read fresh on every
  `server_build()` (DESIGN §3 rule 3) and handed to the caller, who passes it back to the
  calls measured against it (`build=`: its `engines.zero_rule`, SGLang's reporting flag, is
  how a missing count is read; without a build, none is); only `default_model` (the first
  `/v1/models` id) is read once per client.
- The API key (`api_key=`, else env `PREFIXREG_API_KEY`) is sent as `Authorization: Bearer`
  and nowhere else: not in `repr`, an exception message or a log line.
- A chat call that got a 200 never raises for what its body then says (an error frame, a
  truncated stream, a malformed line, not a final JSON response): its evidence is
  `unverified` with an `error` code, so the call can be recorded. Past the deadline or over
  the cap it raises (`WorkerTimeoutError`, `ReplyTooLargeError`).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from prefixreg.core.errors import (
    ArgumentTypeError,
    MalformedResponseError,
    UsageError,
    WorkerHTTPError,
)
from prefixreg.core.frame import Frame
from prefixreg.core.jsonio import JSONObject, dumps_checked, dumps_ordered
from prefixreg.core.prefix import Prefix, check_history, check_text
from prefixreg.core.records import CacheCounters, CallEvidence, ServerBuild
from prefixreg.server import engines
from prefixreg.server.counters import parse_prometheus
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.replies import ReplyReader
from prefixreg.server.sse import SSEParser
from prefixreg.server.transport import DEFAULT_MAX_BYTES, Transport, check_seconds, shown

API_KEY_ENV: Final = "PREFIXREG_API_KEY"
PROFILES: Final = ("halogen", "llamacpp", *engines.ENGINES, "generic")
_SGLANG_INFO: Final = ("/server_info", "/get_server_info")
_CHAT: Final = "/v1/chat/completions"
_COMPLETIONS: Final = "/v1/completions"
_NO_ROUTE: Final = frozenset({404, 405, 501})
_HEADER: Final = re.compile(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+)\n([ -~]*)")


class Worker:
    """A client for one worker URL (its root; a trailing `/v1` is dropped), a context manager:
    `profile` forced, default chat `model`, reply cap `max_bytes`, an httpx `transport` (tests)."""

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
        transport: object = None,
    ) -> None:
        if profile is not None and profile not in PROFILES:
            raise UsageError(f"unknown profile {shown(profile)}; one of {', '.join(PROFILES)}")
        for what, value in (("api_key", api_key), ("model", model)):
            if value is not None and not isinstance(value, str):
                raise UsageError(f"{what} must be a string, not {type(value).__name__}")
        self.timeout = check_seconds("timeout", timeout)
        self.read_timeout = check_seconds("read_timeout", read_timeout)
        self._small = min(self.timeout, self.read_timeout)  # a small route's deadline
        self.profile, self.model = profile, model
        key = (api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")).strip()
        if not all(" " < ch < "\x7f" for ch in key):
            raise UsageError(
                f"the API key (argument or {API_KEY_ENV}) must be printable ASCII without spaces"
            )
        self._key = key or None
        self._http = Transport(url, key=self._key, max_bytes=max_bytes, transport=transport)
        self.url, self.max_bytes = self._http.url, self._http.max_bytes
        self._default_model: str | bool | None = False  # not read yet (see `default_model`)

    def __repr__(self) -> str:
        auth = "set" if self._key is not None else "none"
        return f"Worker({self.url!r}, profile={self.profile!r}, api_key={auth})"

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _get(self, path: str, missing: frozenset[int] = _NO_ROUTE) -> JSONObject | None:
        return self._http.fetch(dict, path, seconds=self._small, missing=missing)

    def _try(self, path: str) -> JSONObject | None:
        """A detection read: a route that errors or is not JSON simply does not match."""
        try:
            return self._get(path)
        except (WorkerHTTPError, MalformedResponseError):
            return None

    def post_json(
        self, path: str, body: JSONObject, *, seconds: float, missing: frozenset[int] = frozenset()
    ) -> JSONObject | None:
        """POST `body` to a small route within `seconds`: the reply; None (status in `missing`)."""
        given: tuple[object, ...] = (path, body, missing)
        if not isinstance(given[0], str) or not path.startswith("/") or not path.isprintable():
            raise UsageError(f"post_json(): a path on the worker (/...), not {shown(path)}")
        if not isinstance(given[1], dict) or not isinstance(given[2], frozenset):
            raise UsageError("post_json(): the body is a dict and `missing` a frozenset")
        content = check_body(body, "post_json()")
        seconds = min(check_seconds("seconds", seconds), self.read_timeout)
        return self._http.fetch(dict, path, seconds=seconds, content=content, missing=missing)

    def health(self) -> JSONObject:
        return self._get("/health", frozenset()) or {}  # never None: no status is `missing`

    def models(self) -> JSONObject:
        return self._get("/v1/models", frozenset()) or {}

    def cache_raw(self) -> JSONObject | None:
        """GET /cache as sent; None when the server has none (404, 405, 501)."""
        return self._get("/cache")

    def cache(self) -> CacheCounters | None:
        """GET /cache as strict counters; None when the server has no /cache."""
        raw = self.cache_raw()
        return None if raw is None else CacheCounters.from_server(raw)

    def props(self) -> JSONObject | None:
        return self._get("/props")

    def slots(self) -> list[JSONObject] | None:
        """GET /slots (llama.cpp), one object per slot; None when the route is off."""
        body = self._http.fetch(list, "/slots", seconds=self._small, missing=_NO_ROUTE)
        return None if body is None else [s for s in body if isinstance(s, dict)]

    def metrics(self, path: str = "/metrics") -> dict[str, float] | None:
        """GET /metrics (or an engine's `METRICS` path) as samples by name; None when it is off."""
        if path not in ("/metrics", *(m.path for m in engines.METRICS.values())):
            raise UsageError(f"metrics(): a Prometheus route, not {shown(path)}")
        raw = self._http.fetch(bytes, path, seconds=self._small, missing=_NO_ROUTE)
        return None if raw is None else parse_prometheus(raw)

    def template_tokens(self, body: Mapping[str, Any]) -> int | None:
        """llama.cpp: the prompt tokens its template renders for `body`; None if it cannot say."""
        if not isinstance(body, Mapping):
            raise UsageError(f"template_tokens() reads a chat body, not {type(body).__name__}")
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

    def _detect(self) -> tuple[str, dict[str, JSONObject | None]]:
        """(profile, the bodies read on the way by route), each route read at most once. A
        /health missing or not JSON matches nothing; one that errors (503 while loading, a
        timeout, too large) raises: a guess from a sick server binds the wrong identity."""
        try:
            seen: dict[str, JSONObject | None] = {"/health": self._get("/health")}
        except MalformedResponseError:
            seen = {"/health": None}

        def read(route: str) -> JSONObject | None:
            if route not in seen:
                seen[route] = self._try(route)
            return seen[route]

        if self.profile is not None:
            return self.profile, seen
        if engines.is_halogen(seen["/health"]):
            return "halogen", seen
        if "build_info" in (read("/props") or {}):
            return "llamacpp", seen
        if any(engines.sglang_info(read(r)) for r in _SGLANG_INFO):
            return "sglang", seen
        if (owner := engines.owned_by(read("/v1/models"))) is not None:
            return owner, seen
        if engines.ollama_version(read("/api/version")) is not None:
            return "ollama", seen
        if isinstance((read("/version") or {}).get("version"), str):
            return "vllm", seen  # /version alone (TensorRT-LLM lists itself as owner first)
        return "generic", seen

    def detect_profile(self) -> str:
        return self._detect()[0]

    def server_build(self) -> ServerBuild:
        """The server's identity now (DESIGN §4). Pass it to the calls measured against it
        (`chat(build=)`): the flag that reads a missing count is part of the identity, so
        checking this build catches a restart that turned it off."""
        profile, seen = self._detect()

        def read(route: str) -> JSONObject | None:
            """What detection read, else read now: an error raises (a sick server's identity
            would be another build), a route the server lacks is None."""
            return seen.get(route) or self._get(route)

        if profile == "halogen":
            identity = engines.halogen_identity(seen["/health"] or self.health())
        elif profile == "llamacpp":
            identity = engines.llamacpp_identity(read("/props") or {})
        elif profile == "vllm":
            identity = engines.vllm_identity(read("/version"), read("/v1/models"))
        elif profile == "sglang":
            info = next((i for r in _SGLANG_INFO if (i := engines.sglang_info(read(r)))), {})
            identity = engines.sglang_identity(info, read("/v1/models"))
        elif profile in ("trtllm", "ollama"):
            version = read("/version" if profile == "trtllm" else "/api/version")
            identity = engines.engine_identity(version, read("/v1/models"))
        else:
            identity = engines.generic_identity(read("/v1/models"))
        return ServerBuild(profile=profile, identity=identity)

    def default_model(self) -> str | None:
        """The chat model when none is named: `/v1/models`' first id (read once), else None."""
        if self._default_model is False:
            ids_listed = engines.generic_identity(self._try("/v1/models")).get("model_ids")
            first = ids_listed[0] if isinstance(ids_listed, list) and ids_listed else None
            self._default_model = first if isinstance(first, str) else None
        return self._default_model if isinstance(self._default_model, str) else None

    def chat(
        self,
        prefix: Prefix | Frame | str,
        tail: str | None = None,
        *,
        history: Sequence[Mapping[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        stream: bool = True,
        headers: Mapping[str, str] | None = None,
        build: ServerBuild | None = None,
        **params: Any,
    ) -> tuple[JSONObject, CallEvidence]:
        """One chat call (`prefix`, then the `tail` or the OpenAI-shaped `history`, `tools`,
        `params`): the reply (`ReplyReader.view`) and its evidence. A `Frame` sends its verified
        system bytes, tools and settings; a `str` is sent as is (unverified). `headers` go with
        this call only (a router's key). Streams ask for `stream_options.include_usage`.
        `build` (`server_build()`) is the build the call is measured against: its rule reads a
        missing cached count (`engines.zero_rule`); without one, a missing count is unverified.

        Raises UsageError: a wrong argument, or a body that is not JSON by the project's rules
        (nothing is sent); WorkerError: HTTP errors, the deadline, the reply cap."""
        for reserved in ("messages", "stream"):
            if reserved in params:
                raise UsageError(f"chat() sets {reserved!r} itself; do not pass it")
        if not isinstance(prefix, Prefix | Frame | str):
            raise UsageError(f"chat() sends a Prefix, Frame or str, not {type(prefix).__name__}")
        given: tuple[object, ...] = (stream, tools)  # callers outside the type checker
        if not isinstance(given[0], bool) or not isinstance(given[1], list | None):
            raise UsageError("chat(): stream is True or False, tools a list or None")
        _check_build(build, "chat()")
        if (tail is None) == (history is None):
            raise UsageError("chat() takes a tail or a history, exactly one of them")
        if history is None:
            history = [{"role": "user", "content": check_text(tail, "the tail")}]
        if tools is not None:
            params["tools"] = tools  # a Frame refuses tools other than its own
        if isinstance(prefix, str):
            system = {"role": "system", "content": prefix}
            body = {**params, "messages": [system, *check_history(history)]}
        else:
            body = prefix.body(history, **params)
        body["stream"] = stream
        if stream:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {})}
            body["stream_options"]["include_usage"] = True
        named = body.get("model") or self.model
        asks = not named and self._default_model is False  # a first call asks `/v1/models`
        if not asks:
            _set_model(body, named or self.default_model())  # known: no request
        extra, content = _check_headers(headers), check_body(body)  # before any request
        if asks and _set_model(body, self.default_model()):
            content = dumps_checked(body)  # a str read as JSON keeps the checked body JSON
        return self._post_chat(content, stream=stream, extra=extra, build=build)

    def complete(
        self, prompt: str | Sequence[int], *, build: ServerBuild | None = None, **params: Any
    ) -> tuple[JSONObject, CallEvidence]:
        """One streamed `/v1/completions` call of `prompt`: text, or token IDs (a list of ints
        0..2**32-1, sent as a token prompt: the engine must take one). The reply and its
        evidence, measured as `chat` measures (`build` as there). Raises as `chat` does."""
        for reserved in ("prompt", "stream"):
            if reserved in params:
                raise UsageError(f"complete() sets {reserved!r} itself; do not pass it")
        _check_build(build, "complete()")
        given: object = prompt  # callers outside the type checker
        if isinstance(given, str) and given:
            sent: str | list[int] = check_text(given, "the prompt")
        elif (
            isinstance(given, list | tuple)
            and given
            and all(type(t) is int and 0 <= t < 1 << 32 for t in given)
        ):
            sent = list(given)
        else:
            raise UsageError("complete() sends a non-empty str or list of token IDs")
        options = params.get("stream_options")
        usage = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        body = {**params, "prompt": sent, "stream": True, "stream_options": usage}
        model = body.get("model") or self.model or self.default_model()
        if model is not None:
            body["model"] = model
        content = check_body(body, "complete()")
        return self._post_chat(content, stream=True, extra={}, route=_COMPLETIONS, build=build)

    def _post_chat(
        self,
        content: bytes,
        *,
        stream: bool,
        extra: dict[str, str],
        build: ServerBuild | None,
        route: str = _CHAT,
    ) -> tuple[JSONObject, CallEvidence]:
        headers = {**extra, "Content-Type": "application/json"}
        if stream:
            headers["Accept"] = "text/event-stream"
        reply, first, started = ReplyReader(), None, time.perf_counter()
        with self._http.call(
            "POST", route, seconds=self.read_timeout, content=content, headers=headers
        ) as call:
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
                reply.take_response(b"".join(call.pieces(drop_ok=True)))
        wall = time.perf_counter() - started
        ttft = None if first is None else first - started
        rule = None if build is None else engines.zero_rule(build.profile, build.identity)
        evidence = evidence_from_response(reply, wall_s=wall, ttft_s=ttft, zero_rule=rule)
        return reply.view(), evidence


def check_worker(worker: object, argument: str = "worker") -> None:
    """Refuse (`ArgumentTypeError`) what is not a Worker at a public function's door; a URL
    string is the likely slip, told how to make one."""
    if isinstance(worker, str):
        why = f"{argument} is a Worker, not the URL {worker!r:.80}: pass prefixreg.Worker(url)"
        raise ArgumentTypeError(why, hint="use the Worker as a context manager to close it")
    if not callable(getattr(worker, "server_build", None)):
        got = "None" if worker is None else type(worker).__name__
        raise ArgumentTypeError(f"{argument} is a Worker (prefixreg.Worker(url)), not {got}")


def check_body(body: object, what: str = "chat()") -> bytes:
    """The bytes of a request body that is JSON by the project's rules (what `chat` sends),
    else `UsageError` naming `what`."""
    try:
        return dumps_ordered(body).encode("utf-8")
    except (TypeError, ValueError) as exc:  # orjson's encode error is a TypeError
        raise UsageError(f"{what}: the request is not JSON the server can read: {exc}") from None


def _set_model(body: dict[str, Any], model: str | None) -> bool:
    """Name `model` in `body` (None: the server's default); whether the body changed."""
    if model is None or model == body.get("model"):
        return False
    body["model"] = model
    return True


def _check_build(build: object, what: str) -> None:
    if build is not None and not isinstance(build, ServerBuild):
        got = type(build).__name__
        raise ArgumentTypeError(
            f"{what}: build is a ServerBuild (server_build()) or None, not {got}"
        )


def _check_headers(headers: object) -> dict[str, str]:
    """A call's own headers: names are HTTP tokens, values printable ASCII."""
    if headers is None:
        return {}
    if not isinstance(headers, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and _HEADER.fullmatch(f"{k}\n{v}")
        for k, v in headers.items()
    ):
        raise UsageError("chat(): headers map header names to printable ASCII values")
    return dict(headers)

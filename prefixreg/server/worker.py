"""The HTTP client for one worker: /health, /cache, /props, /slots, /metrics, /v1/models, chat.

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

    build identity (`server_build`), per profile:
    halogen   version.*, model, chat_template.sha256, checkpoint_format, context, slots,
              slot_ctx, the whole prompt_cache block
    llamacpp  /props build_info, model_path, default_generation_settings.n_ctx,
              total_slots, sha256 of chat_template
    vllm      /version's version, and each /v1/models id with its max_model_len
    generic   the sorted model ids of /v1/models (None when the route is missing)

Only halogen can prove counter-level facts (hits, misses, evictions); every profile can
prove per-call cold/reused when its usage carries the counts (DESIGN §4). A count the
server did not send is never read as zero: a vLLM started without prompt-token details
gives `unverified` evidence, not `cold`.

Invariants:

- The build identity is read fresh on every `server_build()` call (DESIGN §3 rule 3); only
  identity fields go into it, never load (`in_flight`, `busy`, `queued`, ...).
- The API key (`api_key=`, else env `PREFIXREG_API_KEY`) is sent as `Authorization: Bearer`
  and nowhere else: not in `repr`, not in an exception message, not in a log line.
- Errors are the `prefixreg.core.errors` tree, each a one-line message naming the method and path:
  connection refused -> `WorkerUnreachableError`; a timeout -> `WorkerTimeoutError`;
  503 `engine_busy` -> `EngineBusyError`; other 4xx/5xx -> `WorkerHTTPError` carrying the
  server's own message (first line, <= 200 characters); a body that is not the JSON promised
  -> `MalformedResponseError`.
- Timeouts are explicit: `timeout` (default 10 s) for connecting and for the small routes;
  `read_timeout` (default 1800 s) for chat, because a cold prefill can take minutes.
- A chat call that got a 200 never raises for what the stream then says: an error frame, a
  truncated stream or a malformed line give evidence `unverified` with an `error` code.
- Proxies are taken from the environment only if the user set them (httpx `trust_env`).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import httpx
import orjson

from prefixreg.core.errors import (
    EngineBusyError,
    MalformedResponseError,
    UsageError,
    WorkerHTTPError,
    WorkerTimeoutError,
    WorkerUnreachableError,
)
from prefixreg.core.jsonio import JSONObject, JSONValue
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CacheCounters, CallEvidence, ServerBuild
from prefixreg.server.evidence import (
    SSEParser,
    assemble_reply,
    evidence_from_response,
    evidence_from_sse,
)

__all__ = ["API_KEY_ENV", "PROFILES", "Worker"]

API_KEY_ENV: Final = "PREFIXREG_API_KEY"
PROFILES: Final = ("halogen", "llamacpp", "vllm", "generic")

_NO_ROUTE = frozenset({404, 405, 501})
_HALOGEN_IDENTITY = ("model", "checkpoint_format", "context", "slots", "slot_ctx")
_MESSAGE_MAX = 200


def _display_url(url: str) -> str:
    """The URL without user info, query or fragment: safe to print."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _one_line(text: str, limit: int = _MESSAGE_MAX) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Worker:
    """A client for one worker URL (the server root; a trailing `/v1` is dropped).

    Use as a context manager, or call `close()`. `profile` forces a server profile instead
    of detecting it; `model` is sent as the chat `model` unless a call passes its own;
    `transport` is for tests (an `httpx` transport).
    """

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 10.0,
        read_timeout: float = 1800.0,
        profile: str | None = None,
        model: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        base = url.strip().rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        try:
            parts = urlsplit(base)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
            valid = valid and (parts.port is None or parts.port > 0)  # .port raises if bad
            shown = _display_url(base)
        except ValueError:
            valid, shown = False, base.split("@")[-1]  # never echo user info (a password)
        if not valid:
            raise UsageError(f"not a worker URL (http://host:port): {shown!r}")
        if profile is not None and profile not in PROFILES:
            raise UsageError(f"unknown server profile {profile!r}; one of {', '.join(PROFILES)}")
        self.url = _display_url(base)
        self.profile = profile
        self.model = model
        # vLLM refuses (or guesses) a chat without `model`: the first served id, as read
        # by the last `server_build()`, is sent when neither the caller nor `model=` says.
        self._served_model: str | None = None
        self.timeout = timeout
        self.read_timeout = read_timeout
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        key = key.strip() if key else None
        if key and not all(" " < ch < "\x7f" for ch in key):
            raise UsageError(
                f"the API key (argument or {API_KEY_ENV}) must be printable ASCII without spaces"
            )
        self._key = key or None
        headers = {"Accept": "application/json"}
        if self._key is not None:
            headers["Authorization"] = f"Bearer {self._key}"
        self._client = httpx.Client(
            base_url=base,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            transport=transport,
            follow_redirects=False,
        )

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
        self._client.close()

    # ---------------------------------------------------------------- transport + errors

    def _where(self, method: str, path: str) -> str:
        return f"{method} {path} on {self.url}"

    def _scrub(self, text: str) -> str:
        """Remove the API key from text we did not write (a server echoing a header)."""
        if self._key:
            text = text.replace(self._key, "***")
        return text

    @contextmanager
    def _mapped(self, method: str, path: str) -> Iterator[None]:
        """Turn httpx transport errors into the prefixreg error tree."""
        where = self._where(method, path)
        try:
            yield
        except httpx.TimeoutException as exc:
            kind = type(exc).__name__.replace("Timeout", " timeout").strip().lower()
            raise WorkerTimeoutError(
                f"{where}: no reply in time ({kind})",
                url=self.url,
                hint="raise the timeout, or check that the worker is not stuck",
            ) from None
        except httpx.DecodingError:
            raise MalformedResponseError(
                f"{where}: the reply body could not be decoded", url=self.url
            ) from None
        except httpx.TransportError as exc:
            detail = _one_line(self._scrub(str(exc))) or type(exc).__name__
            raise WorkerUnreachableError(
                f"{where}: cannot reach the worker ({detail})",
                url=self.url,
                hint="is the worker running, and is the URL right?",
            ) from None

    def _raise_for_status(self, method: str, path: str, resp: httpx.Response) -> None:
        if resp.status_code < 300:
            return
        if resp.status_code < 400:
            raise WorkerHTTPError(
                f"{self._where(method, path)}: HTTP {resp.status_code}: redirect not followed",
                status_code=resp.status_code,
                url=self.url,
                hint="give the worker's final URL",
            )
        message, code = "", None
        try:
            body: Any = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict):
                raw_msg, raw_code = err.get("message"), err.get("code")
                message = raw_msg if isinstance(raw_msg, str) else ""
                code = raw_code if isinstance(raw_code, str) else None
            elif isinstance(err, str):
                message = err
            elif isinstance(body.get("detail"), str):
                message = body["detail"]
        elif resp.content:
            message = resp.text
        # The reason phrase is the server's text too: scrub it like the body.
        text = _one_line(self._scrub(message or resp.reason_phrase or "")) or "no message"
        full = f"{self._where(method, path)}: HTTP {resp.status_code}: {text}"
        if resp.status_code == 503 and code == "engine_busy":
            raise EngineBusyError(
                full,
                status_code=503,
                code=code,
                url=self.url,
                hint="the worker serves one request at a time; retry when it is idle",
            )
        raise WorkerHTTPError(full, status_code=resp.status_code, code=code, url=self.url)

    def _json_object(self, method: str, path: str, resp: httpx.Response) -> JSONObject:
        try:
            body: JSONValue = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            ctype = resp.headers.get("content-type", "no content type")
            raise MalformedResponseError(
                f"{self._where(method, path)}: the reply is not JSON ({_one_line(ctype, 60)})",
                url=self.url,
            ) from None
        if not isinstance(body, dict):
            raise MalformedResponseError(
                f"{self._where(method, path)}: the reply is not a JSON object", url=self.url
            )
        return body

    def _get(self, path: str, *, missing_ok: bool = False) -> JSONObject | None:
        with self._mapped("GET", path):
            resp = self._client.get(path)
        if missing_ok and resp.status_code in _NO_ROUTE:
            return None
        self._raise_for_status("GET", path, resp)
        return self._json_object("GET", path, resp)

    # ---------------------------------------------------------------- small routes

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

    def version(self) -> JSONObject | None:
        """GET /version (vLLM); None when the server has no such route."""
        return self._get("/version", missing_ok=True)

    def _get_body(self, path: str) -> bytes | None:
        """GET `path` as raw bytes; None when the route is missing (404, 405, 501)."""
        with self._mapped("GET", path):
            resp = self._client.get(path)
        if resp.status_code in _NO_ROUTE:
            return None
        self._raise_for_status("GET", path, resp)
        return resp.content

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
                f"{self._where('GET', '/slots')}: the reply is not a JSON list", url=self.url
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
        samples: dict[str, float] = {}
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line or line.startswith("#"):
                continue
            # `name{labels} value [timestamp]`; llama.cpp sends neither labels nor timestamps.
            parts = line.split()
            if len(parts) < 2:
                continue
            try:
                samples[parts[0]] = float(parts[1])
            except ValueError:
                continue
        return samples

    # ---------------------------------------------------------------- profile + build

    def _health_or_none(self) -> JSONObject | None:
        """/health, or None when the server has no such route or answers it with non-JSON.

        A server error (503 while loading, `engine_unresponsive`) raises: guessing a profile
        from a sick server would bind measurements to the wrong identity.
        """
        try:
            return self._get("/health", missing_ok=True)
        except MalformedResponseError:
            return None

    @staticmethod
    def _is_halogen(health: Mapping[str, object] | None) -> bool:
        return health is not None and ("prompt_cache" in health or "cache_counters" in health)

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
        if self._is_halogen(health):
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
            return ServerBuild(profile=profile, identity=_halogen_identity(health or self.health()))
        if profile == "llamacpp":
            if body is None:
                body = self.props()
            return ServerBuild(profile=profile, identity=_llamacpp_identity(body or {}))
        models = self._get("/v1/models", missing_ok=True)
        if profile == "vllm":
            if body is None:
                body = self._probe(self.version)
            identity = _vllm_identity(body, models)
            served = identity.get("models")
            first = served[0] if isinstance(served, list) and served else None
            name = first.get("id") if isinstance(first, dict) else None
            self._served_model = name if isinstance(name, str) else None
            return ServerBuild(profile=profile, identity=identity)
        identity = _generic_identity(models)
        ids = identity.get("model_ids")
        # Generic OpenAI-compatible servers (SGLang, ...) need `model`: send the first id.
        self._served_model = (
            ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], str) else None
        )
        return ServerBuild(profile=profile, identity=identity)

    # ---------------------------------------------------------------- chat

    def chat(
        self,
        prefix: Prefix | str,
        tail: str,
        *,
        stream: bool = True,
        headers: Mapping[str, str] | None = None,
        **params: Any,
    ) -> tuple[JSONObject, CallEvidence]:
        """One chat call: `messages = prefix.messages(tail)` plus `params` (max_tokens, ...).

        Returns the reply (`content`, `reasoning`, `finish_reason`, `usage`, `timings`,
        `model`, `id`; see `evidence.assemble_reply`) and the call's evidence. `headers` are
        sent with this call only (a router's routing key, `x-smg-routing-key`). Streams ask
        for `stream_options.include_usage`. HTTP errors raise; what a 200 stream says does
        not (an error frame gives `unverified` evidence). A plain `str` prefix is sent as the
        system message as is: nothing verifies it.
        """
        for reserved in ("messages", "stream"):
            if reserved in params:
                raise UsageError(f"chat() sets {reserved!r} itself; do not pass it")
        if isinstance(prefix, Prefix):
            messages = prefix.messages(tail)
        else:
            messages = [{"role": "system", "content": prefix}, {"role": "user", "content": tail}]
        body: dict[str, Any] = {}
        if self.model is not None:
            body["model"] = self.model
        elif self._served_model is not None:
            body["model"] = self._served_model
        body.update(params)
        body["messages"] = messages
        body["stream"] = stream
        if stream:
            options = params.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {})}
            body["stream_options"]["include_usage"] = True
        return self._post_chat("/v1/chat/completions", body, stream=stream, extra=headers)

    def _post_chat(
        self,
        path: str,
        body: dict[str, Any],
        *,
        stream: bool,
        extra: Mapping[str, str] | None = None,
    ) -> tuple[JSONObject, CallEvidence]:
        timeout = httpx.Timeout(self.timeout, read=self.read_timeout)
        content = orjson.dumps(body)
        headers = {**(extra or {}), "Content-Type": "application/json"}
        if stream:
            headers["Accept"] = "text/event-stream"
        started = time.perf_counter()
        with (
            self._mapped("POST", path),
            self._client.stream(
                "POST", path, content=content, headers=headers, timeout=timeout
            ) as resp,
        ):
            if resp.status_code >= 300:
                resp.read()
                self._raise_for_status("POST", path, resp)
            ctype = resp.headers.get("content-type", "")
            if not stream or not ctype.startswith("text/event-stream"):
                resp.read()
                data = self._json_object("POST", path, resp)
                wall = time.perf_counter() - started
                return assemble_reply(data), evidence_from_response(data, wall_s=wall)
            return self._read_stream(resp, started)

    def _read_stream(self, resp: httpx.Response, started: float) -> tuple[JSONObject, CallEvidence]:
        parser = SSEParser()
        first: float | None = None
        try:
            for piece in resp.iter_bytes():
                for frame in parser.feed(piece):
                    if first is None and _has_text(frame):
                        first = time.perf_counter()
                if parser.stream.done:
                    break
        except httpx.TimeoutException:
            raise
        except httpx.TransportError:
            pass  # dropped mid-stream: the stream has no [DONE], so it is incomplete
        stream = parser.finish()
        wall = time.perf_counter() - started
        ttft = None if first is None else first - started
        evidence = evidence_from_sse(stream, wall_s=wall, ttft_s=ttft)
        return assemble_reply(stream), evidence


def _has_text(frame: object) -> bool:
    """Whether a stream frame carries a non-empty content or reasoning piece."""
    if not isinstance(frame, dict):
        return False
    choices = frame.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")):
            return True
    return False


def _sha256_text(value: object) -> str | None:
    return hashlib.sha256(value.encode("utf-8")).hexdigest() if isinstance(value, str) else None


def _halogen_identity(health: Mapping[str, JSONValue]) -> JSONObject:
    template = health.get("chat_template")
    identity: JSONObject = {
        "version": health.get("version"),
        "chat_template_sha256": template.get("sha256") if isinstance(template, dict) else None,
        "prompt_cache": health.get("prompt_cache"),
    }
    for key in _HALOGEN_IDENTITY:
        identity[key] = health.get(key)
    return identity


def _llamacpp_identity(props: Mapping[str, JSONValue]) -> JSONObject:
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return {
        "build_info": props.get("build_info"),
        "model_path": props.get("model_path"),
        "n_ctx": n_ctx,
        "total_slots": props.get("total_slots"),
        "chat_template_sha256": _sha256_text(props.get("chat_template")),
    }


def _generic_identity(models: Mapping[str, JSONValue] | None) -> JSONObject:
    if models is None:
        return {"model_ids": None}
    data = models.get("data")
    ids: list[JSONValue] = []
    if isinstance(data, list):
        names = {m.get("id") for m in data if isinstance(m, dict)}
        ids.extend(sorted(n for n in names if isinstance(n, str)))
    return {"model_ids": ids}


def _vllm_identity(
    version: Mapping[str, JSONValue] | None, models: Mapping[str, JSONValue] | None
) -> JSONObject:
    """vLLM: its version, and each served model id with its `max_model_len`, by id."""
    raw = version.get("version") if version is not None else None
    served: dict[str, JSONValue] = {}
    data = models.get("data") if models is not None else None
    if isinstance(data, list):
        for model in data:
            if isinstance(model, dict) and isinstance(model.get("id"), str):
                length = model.get("max_model_len")
                served[str(model["id"])] = length if type(length) is int else None
    listed: list[JSONValue] = [
        {"id": name, "max_model_len": served[name]} for name in sorted(served)
    ]
    return {
        "version": raw if isinstance(raw, str) else None,
        "models": None if models is None else listed,
    }

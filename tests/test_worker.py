"""Behaviour of `server.worker.Worker` against a real loopback server (`tests.fakeserver`)."""

from __future__ import annotations

import copy
import hashlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.digest import output_digest
from prefixreg.core.errors import (
    EngineBusyError,
    MalformedResponseError,
    UsageError,
    WorkerError,
    WorkerHTTPError,
    WorkerTimeoutError,
    WorkerUnreachableError,
)
from prefixreg.core.prefix import Prefix
from prefixreg.core.records import CacheCounters
from prefixreg.registry.store import Registry
from prefixreg.server.evidence import SOURCE_TIMINGS, SOURCE_USAGE
from prefixreg.server.worker import Worker
from prefixreg.verbs.doctor.run import diagnose
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request, sse_frames

KEY = "sk-test-0123456789abcdef"
CHAT = "/v1/chat/completions"

HALOGEN_HEALTH: dict[str, Any] = {
    "status": "ok",
    "model": "flash",
    "cache_counters": "/cache",
    "context": 262144,
    "version": {"api": "0.17.3", "engine": "0.17.3", "match": True},
    "checkpoint_format": "hgn",
    "chat_template": {"path": "t.jinja", "sha256": "c" * 64, "probe": "ok"},
    "busy": False,
    "slots": 4,
    "slot_ctx": 262144,
    "in_flight": 0,
    "queued": 0,
    "prompt_cache": {
        "enabled": True,
        "cap_mb": 110,
        "mode": 2,
        "snapshot_align": 64,
        "bitwise_identical_to_cold": False,
    },
}
HALOGEN_CACHE = {
    "entries": 3,
    "max_entries": 8,
    "hits": 5,
    "misses": 2,
    "stores": 7,
    "hit_rate": 0.7,
}
LLAMA_PROPS: dict[str, Any] = {
    "default_generation_settings": {"params": {}, "n_ctx": 8192},
    "total_slots": 4,
    "model_alias": "peer",
    "model_path": "/models/gemma-3-270m.gguf",
    "chat_template": "{{ messages }}",
    "build_info": "b6000-abcdef",
}
PREFIX = Prefix.from_text("d" * 64, "You are a careful assistant. " * 20, name="loop")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServer]:
    monkeypatch.delenv("PREFIXREG_API_KEY", raising=False)
    with FakeServer() as srv:
        yield srv


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def stream_reply(cached: int | None = 7, *, pieces: tuple[str, ...] = ("Hel", "lo")) -> list[Any]:
    use: dict[str, Any] = {"prompt_tokens": 8, "completion_tokens": 2, "total_tokens": 10}
    if cached is not None:
        use["prompt_tokens_details"] = {"cached_tokens": cached}
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}], "usage": None}
        for p in pieces
    ]
    frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": None})
    frames.append({"choices": [], "usage": use, "timings": {"cache_n": cached or 0}})
    return frames


def assert_clean(exc: BaseException, *, key: str = KEY) -> None:
    """One line, and no API key anywhere in what the exception carries."""
    text = str(exc)
    assert "\n" not in text
    for part in (text, repr(exc), repr(exc.args), getattr(exc, "hint", None) or ""):
        assert key not in part


# ------------------------------------------------------------------ profiles


def test_detects_halogen_from_health(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
    with Worker(server.url) as w:
        assert w.detect_profile() == "halogen"
    assert "/props" not in server.paths()


def test_detects_dense_halogen_from_prompt_cache_alone(server: FakeServer) -> None:
    dense = {"status": "ok", "model": "m", "prompt_cache": {"enabled": True, "cap_mb": 0}}
    server.route("GET", "/health", Reply(json=dense))
    with Worker(server.url) as w:
        assert w.detect_profile() == "halogen"


def test_detects_llamacpp_from_props(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    server.route("GET", "/props", Reply(json=LLAMA_PROPS))
    with Worker(server.url) as w:
        assert w.detect_profile() == "llamacpp"
        build = w.server_build()
    assert build.profile == "llamacpp"
    assert build.identity == {
        "build_info": "b6000-abcdef",
        "model_path": "/models/gemma-3-270m.gguf",
        "n_ctx": 8192,
        "total_slots": 4,
        "chat_template_sha256": hashlib.sha256(b"{{ messages }}").hexdigest(),
    }


def test_detects_generic_when_nothing_else_answers(server: FakeServer) -> None:
    server.route("GET", "/v1/models", Reply(json={"data": [{"id": "b"}, {"id": "a"}, {"x": 1}]}))
    with Worker(server.url) as w:  # /health and /props are 404 here
        assert w.detect_profile() == "generic"
        build = w.server_build()
    assert build.identity == {"model_ids": ["a", "b"]}


def test_forced_profile_wins(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
    with Worker(server.url, profile="generic") as w:
        assert w.detect_profile() == "generic"
    with pytest.raises(UsageError):
        Worker(server.url, profile="tgi")


def test_sick_health_raises_instead_of_guessing(server: FakeServer) -> None:
    err = {"error": {"message": "engine did not answer", "code": "engine_unresponsive"}}
    server.route("GET", "/health", Reply(status=503, json=err))
    with Worker(server.url) as w, pytest.raises(WorkerHTTPError) as info:
        w.server_build()
    assert info.value.status_code == 503 and info.value.code == "engine_unresponsive"


def test_build_id_follows_identity_not_load(server: FakeServer) -> None:
    health = copy.deepcopy(HALOGEN_HEALTH)
    server.route("GET", "/health", lambda _req: Reply(json=copy.deepcopy(health)))
    with Worker(server.url) as w:
        first = w.server_build()
        health.update(in_flight=1, busy=True, queued=3, busy_for_s=12.5)
        assert w.server_build().build_id == first.build_id
        health["prompt_cache"]["cap_mb"] = 220
        changed = w.server_build()
        assert changed.build_id != first.build_id
        health["version"]["engine"] = "0.17.4"
        assert w.server_build().build_id not in (first.build_id, changed.build_id)
    assert first.identity["chat_template_sha256"] == "c" * 64
    assert first.identity["prompt_cache"] == HALOGEN_HEALTH["prompt_cache"]
    assert "in_flight" not in first.identity
    assert server.paths().count("/health") == 4  # read fresh every time


# ------------------------------------------------------------------ small routes


def test_cache_counters_and_missing_cache(server: FakeServer) -> None:
    server.route("GET", "/cache", Reply(json=HALOGEN_CACHE), Reply(status=501, json={}))
    with Worker(server.url) as w:
        assert w.cache() == CacheCounters(entries=3, max_entries=8, hits=5, misses=2, stores=7)
        assert w.cache() is None  # 501: this engine reports no prompt cache
    with FakeServer() as bare, Worker(bare.url) as w:
        assert w.cache() is None  # 404
        assert w.props() is None


def test_models_and_health_return_json(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    server.route("GET", "/v1/models", Reply(json={"object": "list", "data": []}))
    with Worker(server.url + "/v1/") as w:  # a /v1 base URL is accepted
        assert w.health() == {"status": "ok"}
        assert w.models()["object"] == "list"


# ------------------------------------------------------------------ chat


def test_streamed_chat(server: FakeServer) -> None:
    frames = [": keepalive\n\n", *stream_reply(cached=7)]
    server.route("POST", CHAT, Reply(sse=sse_frames(frames), piece_delay=0.02))
    with Worker(server.url, model="flash") as w:
        reply, ev = w.chat(PREFIX, "tail one", max_tokens=8, temperature=0)
    sent = server.requests[-1].json
    assert sent["messages"] == PREFIX.messages("tail one")
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert (sent["model"], sent["max_tokens"], sent["temperature"]) == ("flash", 8, 0)
    assert reply["content"] == "Hello" and reply["finish_reason"] == "stop"
    assert (ev.cache_state, ev.cached_tokens, ev.cached_source) == ("reused", 7, SOURCE_USAGE)
    assert ev.output_sha256 == output_digest(b"Hello", b"")
    assert ev.ttft_s is not None and ev.wall_s is not None and 0 < ev.ttft_s < ev.wall_s


def test_streamed_halogen_cold_reply(server: FakeServer) -> None:
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply(cached=None))))
    with Worker(server.url) as w:
        _, ev = w.chat("plain prefix", "tail")
    assert server.requests[-1].json["messages"][0] == {"role": "system", "content": "plain prefix"}
    assert (ev.cache_state, ev.cached_source) == ("cold", SOURCE_TIMINGS)


def test_non_streamed_chat(server: FakeServer) -> None:
    body = {
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "Hi"}}],
        "usage": {
            "prompt_tokens": 9,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    server.route("POST", CHAT, Reply(json=body))
    with Worker(server.url) as w:
        reply, ev = w.chat(PREFIX, "t", stream=False)
    sent = server.requests[-1].json
    assert sent["stream"] is False and "stream_options" not in sent
    assert reply["content"] == "Hi"
    assert (ev.cache_state, ev.complete, ev.ttft_s) == ("cold", True, None)


def test_stream_error_frame_is_evidence_not_exception(server: FakeServer) -> None:
    frames = [*stream_reply()[:1], {"error": {"message": "engine refused: private detail"}}]
    server.route("POST", CHAT, Reply(sse=sse_frames(frames)))
    with Worker(server.url) as w:
        _, ev = w.chat(PREFIX, "t")
    assert (ev.cache_state, ev.error, ev.complete) == ("unverified", "server_stream_error", False)
    assert "private detail" not in str(ev.to_dict())


def test_truncated_stream_is_incomplete(server: FakeServer) -> None:
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply(), done=False)))
    with Worker(server.url) as w:
        _, ev = w.chat(PREFIX, "t")
    assert (ev.cache_state, ev.error, ev.output_sha256) == ("unverified", "incomplete_stream", None)


def test_reserved_chat_params_are_refused(server: FakeServer) -> None:
    with Worker(server.url) as w, pytest.raises(UsageError):
        w.chat(PREFIX, "t", messages=[])
    assert server.requests == []


# ------------------------------------------------------------------ errors


def test_engine_busy(server: FakeServer) -> None:
    err = {
        "error": {
            "message": "timed out waiting for the engine — halogen serves one request at a time",
            "type": "server_error",
            "param": None,
            "code": "engine_busy",
        }
    }
    server.route("POST", CHAT, Reply(status=503, json=err))
    with Worker(server.url, api_key=KEY) as w, pytest.raises(EngineBusyError) as info:
        w.chat(PREFIX, "t")
    exc = info.value
    assert (exc.status_code, exc.code) == (503, "engine_busy")
    assert str(exc).startswith(f"POST {CHAT} on {server.url}: HTTP 503: timed out waiting")
    assert_clean(exc)


def test_bad_request_carries_the_server_message_on_one_line(server: FakeServer) -> None:
    message = (
        "max_tokens 99999 exceeds this server's cap of 65536.\nThe cap is policy. " + "x" * 400
    )
    server.route(
        "POST", CHAT, Reply(status=400, json={"error": {"message": message, "code": None}})
    )
    with Worker(server.url, api_key=KEY) as w, pytest.raises(WorkerHTTPError) as info:
        w.chat(PREFIX, "t", max_tokens=99999)
    exc = info.value
    assert type(exc) is WorkerHTTPError and exc.status_code == 400
    assert "max_tokens 99999 exceeds this server's cap of 65536. The cap is policy." in str(exc)
    assert len(str(exc)) < 300
    assert_clean(exc)


def test_server_echoing_the_key_is_scrubbed(server: FakeServer) -> None:
    echo = {"error": {"message": f"bad token Bearer {KEY}", "code": "auth"}}
    server.route("GET", "/health", Reply(status=401, json=echo))
    with Worker(server.url, api_key=KEY) as w, pytest.raises(WorkerHTTPError) as info:
        w.health()
    assert "***" in str(info.value)
    assert_clean(info.value)


def test_connection_refused() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with Worker(url, api_key=KEY) as w:
        for call in (w.health, lambda: w.chat(PREFIX, "t")):
            with pytest.raises(WorkerUnreachableError) as info:
                call()
            assert isinstance(info.value, ConnectionError)
            assert info.value.url == url
            assert url in str(info.value)
            assert_clean(info.value)


def test_hangup_before_reply(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(hangup=True))
    with Worker(server.url, api_key=KEY) as w, pytest.raises(WorkerUnreachableError) as info:
        w.health()
    assert_clean(info.value)


def test_body_cut_short_is_unreachable(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH, truncate_at=20))
    with Worker(server.url) as w, pytest.raises(WorkerUnreachableError):
        w.health()


def test_read_timeouts(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}, delay=2))
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply()), delay=2))
    with Worker(server.url, api_key=KEY, timeout=0.2, read_timeout=0.3) as w:
        with pytest.raises(WorkerTimeoutError) as info:
            w.health()
        assert isinstance(info.value, TimeoutError)
        assert "/health" in str(info.value)
        assert_clean(info.value)
        with pytest.raises(WorkerTimeoutError):
            w.chat(PREFIX, "t")


def test_chat_read_timeout_is_separate_from_the_short_one(server: FakeServer) -> None:
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply()), delay=0.4))
    with Worker(server.url, timeout=0.2, read_timeout=5) as w:
        _, ev = w.chat(PREFIX, "t")
    assert ev.cache_state == "reused"


@pytest.mark.parametrize("path", ["/health", "/cache"])
def test_non_json_body_is_malformed(server: FakeServer, path: str) -> None:
    server.route("GET", path, Reply(body=b"<html>oops</html>", content_type="text/html"))
    with Worker(server.url, api_key=KEY) as w, pytest.raises(MalformedResponseError) as info:
        w.health() if path == "/health" else w.cache()
    assert path in str(info.value) and "text/html" in str(info.value)
    assert_clean(info.value)


def test_json_that_is_not_an_object_is_malformed(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=["ok"]))
    with Worker(server.url) as w, pytest.raises(MalformedResponseError):
        w.health()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "malformed_response"),
        (b'["a", "list"]', "malformed_response"),
        (b'{"id": "x", "usage": {"prompt_tokens": 8}}', "malformed_response"),
        (
            b'{"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": null}]}',
            "incomplete_response",
        ),
    ],
)
def test_malformed_non_streamed_chat_body_is_unverified_evidence(
    server: FakeServer, body: bytes, error: str
) -> None:
    """The same state as the same fault in a stream: evidence to record, never an exception."""
    server.route("POST", CHAT, Reply(body=body, content_type="application/json"))
    with Worker(server.url) as w:
        reply, ev = w.chat(PREFIX, "t", stream=False)
    assert (ev.cache_state, ev.complete, ev.error) == ("unverified", False, error)
    assert ev.output_sha256 is None and reply["content"] in ("", "x")


# ------------------------------------------------------------------ the API key


def test_env_key_is_sent_and_never_shown(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXREG_API_KEY", KEY)
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply())))
    with Worker(server.url) as w:
        assert KEY not in repr(w) and "api_key=set" in repr(w)
        w.health()
        w.chat(PREFIX, "t")
        errors: list[WorkerError] = []
        for call in (w.cache, w.models):  # both 404 on this server: /models raises
            try:
                call()
            except WorkerError as exc:
                errors.append(exc)
    assert len(errors) == 1
    for error in errors:
        assert_clean(error)
    assert {r.headers.get("authorization") for r in server.requests} == {f"Bearer {KEY}"}


def test_no_key_no_header(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    with Worker(server.url) as w:
        w.health()
        assert "api_key=none" in repr(w)
    assert "authorization" not in server.requests[-1].headers


def test_key_with_control_characters_is_refused_without_echo(server: FakeServer) -> None:
    with pytest.raises(UsageError) as info:
        Worker(server.url, api_key="sk-bad\nkey")
    assert "sk-bad" not in str(info.value)


def test_bad_worker_url_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        Worker("127.0.0.1:8080")


def test_request_records_are_usable(server: FakeServer) -> None:
    def echo(req: Request) -> Reply:
        return Reply(json={"seen": req.path})

    server.route("GET", "/health", echo)
    with Worker(server.url) as w:
        assert w.health() == {"seen": "/health"}
    assert server.requests[0].method == "GET" and server.requests[0].json is None


# ------------------------------------------------------------------ vLLM and llama.cpp shapes

VLLM_MODELS: dict[str, Any] = {
    "object": "list",
    "data": [
        {"id": "qwen-b", "object": "model", "owned_by": "vllm", "max_model_len": 32768},
        {"id": "qwen-a", "object": "model", "owned_by": "vllm", "max_model_len": 8192},
    ],
}


def vllm_server(server: FakeServer, *, details: bool) -> None:
    """A vLLM-shaped loopback server: /health 200 with an empty body, /version, no /props."""
    server.route("GET", "/health", Reply(body=b""))
    server.route("GET", "/version", Reply(json={"version": "0.11.0"}))
    server.route("GET", "/v1/models", Reply(json=VLLM_MODELS))
    frames = stream_reply(cached=0 if details else None)
    frames[-1].pop("timings")  # vLLM sends no llama.cpp timings
    if not details:
        frames[-1]["usage"].pop("prompt_tokens_details", None)
    server.route("POST", CHAT, Reply(sse=sse_frames(frames)))


def test_detects_vllm_from_version_and_binds_models(server: FakeServer) -> None:
    vllm_server(server, details=True)
    with Worker(server.url) as w:
        assert w.detect_profile() == "vllm"
        build = w.server_build()
        _, ev = w.chat(PREFIX, "t")
    assert build.profile == "vllm"
    assert build.identity == {
        "version": "0.11.0",
        "models": [
            {"id": "qwen-a", "max_model_len": 8192},
            {"id": "qwen-b", "max_model_len": 32768},
        ],
    }
    # vLLM needs `model`: the first served id is sent when nobody chose one.
    assert server.requests[-1].json["model"] == "qwen-a"
    assert (ev.cache_state, ev.cached_source) == ("cold", SOURCE_USAGE)


def test_vllm_build_id_follows_version_and_max_model_len(server: FakeServer) -> None:
    vllm_server(server, details=True)
    with Worker(server.url) as w:
        first = w.server_build().build_id
        longer = copy.deepcopy(VLLM_MODELS)
        longer["data"][1]["max_model_len"] = 16384
        server.route("GET", "/v1/models", Reply(json=longer))
        assert w.server_build().build_id != first
        server.route("GET", "/v1/models", Reply(json=VLLM_MODELS))
        assert w.server_build().build_id == first
        server.route("GET", "/version", Reply(json={"version": "0.11.1"}))
        assert w.server_build().build_id != first


def test_vllm_without_prompt_token_details_is_unverified_never_zero(server: FakeServer) -> None:
    vllm_server(server, details=False)
    with Worker(server.url, model="mine") as w:
        assert w.server_build().profile == "vllm"
        _, ev = w.chat(PREFIX, "t")
    assert server.requests[-1].json["model"] == "mine"  # the caller's model wins
    assert ev.cache_state == "unverified" and ev.cached_tokens is None
    assert ev.reason is not None and "cached_tokens missing" in ev.reason


@pytest.mark.parametrize(
    "version",
    [
        Reply(json={"version": 3}),
        Reply(json={"name": "x"}),
        Reply(body=b"0.11.0"),
        Reply(status=500),
    ],
)
def test_version_that_is_not_vllm_shaped_is_generic(server: FakeServer, version: Reply) -> None:
    server.route("GET", "/version", version)
    server.route("GET", "/v1/models", Reply(json=VLLM_MODELS))
    with Worker(server.url) as w:
        assert w.detect_profile() == "generic"


def test_llamacpp_is_detected_before_version_is_asked(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json={"status": "ok"}))
    server.route("GET", "/props", Reply(json=LLAMA_PROPS))
    server.route("GET", "/version", Reply(json={"version": "0.11.0"}))
    with Worker(server.url) as w:
        assert w.detect_profile() == "llamacpp"
    assert "/version" not in server.paths()


def test_forced_vllm_profile_without_version_route(server: FakeServer) -> None:
    server.route("GET", "/v1/models", Reply(json=VLLM_MODELS))
    with Worker(server.url, profile="vllm") as w:
        build = w.server_build()
    assert build.profile == "vllm" and build.identity["version"] is None


def test_llamacpp_stream_with_its_initial_role_delta(server: FakeServer) -> None:
    """llama.cpp opens a stream with `{"role": "assistant", "content": null}` (reference §5)."""
    meta = {"id": "chatcmpl-1", "model": "peer", "system_fingerprint": "b0-unknown"}
    use = {
        "completion_tokens": 2,
        "prompt_tokens": 556,
        "total_tokens": 558,
        "prompt_tokens_details": {"cached_tokens": 529},
    }
    frames: list[Any] = [
        {
            "choices": [
                {"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}
            ],
            **meta,
        },
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "Ques"}}], **meta},
        {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "tion"}}], **meta},
        {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **meta},
        {"choices": [], **meta, "usage": use, "timings": {"cache_n": 529, "prompt_n": 27}},
    ]
    server.route("POST", CHAT, Reply(sse=sse_frames(frames)))
    with Worker(server.url) as w:
        reply, ev = w.chat(PREFIX, "t", max_tokens=2)
    assert reply["content"] == "Question" and reply["finish_reason"] == "length"
    assert (ev.cache_state, ev.cached_tokens, ev.prompt_tokens) == ("reused", 529, 556)
    assert ev.cached_source == SOURCE_USAGE and ev.complete
    assert ev.output_sha256 == output_digest(b"Question", b"")


def test_doctor_says_what_each_profile_can_and_cannot_prove() -> None:
    texts = {p: diagnose(p, {}, None).findings[0].text for p in ("llamacpp", "vllm", "generic")}
    assert "no cache-entry counters" in texts["llamacpp"]
    assert "--enable-prompt-tokens-details" in texts["vllm"]
    assert "never cold" in texts["vllm"]
    assert "no counters" in texts["generic"]


def test_warm_accepts_profile_vllm(server: FakeServer, tmp_path: Path) -> None:
    vllm_server(server, details=False)
    reg = tmp_path / "reg"
    Registry(reg).add("You are a careful assistant. " * 20, name="loop")
    args = ("warm", "loop", "--worker", server.url, "--registry", str(reg), "--json")
    res = run_cli(*args, "--profile", "vllm")
    # Without prompt-token details the claim cannot be made: unverified (4), never cold.
    assert res.returncode == 4, res.stderr
    receipt = orjson.loads(res.stdout)
    assert receipt["build"]["profile"] == "vllm"
    assert receipt["body"]["verdict"] == "unverified"
    posts = [r for r in server.requests if r.method == "POST"]
    assert posts and all(r.json["model"] == "qwen-a" for r in posts)
    bad = run_cli(*args, "--profile", "tgi")
    assert bad.returncode == 2 and b"vllm" in bad.stderr


# ------------------------------------------------------------------ the typed boundary (#22)


@pytest.mark.parametrize(
    "call",
    [
        lambda url: Worker(url, api_key=123),  # type: ignore[arg-type]
        lambda url: Worker(None),  # type: ignore[arg-type]
        lambda url: Worker(url, timeout="x"),  # type: ignore[arg-type]
        lambda url: Worker(url, transport="x"),
        lambda url: Worker("http://h\n:80"),
        lambda url: Worker(url).chat(PREFIX, history=[1]),  # type: ignore[list-item]
        lambda url: Worker(url).chat(PREFIX, "t", max_tokens=2**70),
        lambda url: Worker(url).chat(PREFIX, "\ud800"),
        lambda url: Worker(url).chat(None, "t"),  # type: ignore[arg-type]
        lambda url: Worker(url).chat("s", "t", stream="yes"),  # type: ignore[arg-type]
        lambda url: Worker(url).chat("s", "t", headers={"x-key": "a\r\nb"}),
        lambda url: Worker(url).chat("s", "t", extra={"when": object()}),
        lambda url: Worker(url).post_json("/slots/0?action=save", {"n": float("nan")}, seconds=1),
        lambda url: Worker(url).template_tokens(None),  # type: ignore[arg-type]
    ],
)
def test_wrong_arguments_are_usage_errors_and_nothing_is_sent(
    server: FakeServer, call: Any
) -> None:
    with pytest.raises(UsageError):
        call(server.url)
    assert server.requests == []

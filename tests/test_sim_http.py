"""The simulator over real loopback HTTP: field names, omission rules, streams, errors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prefixreg.core.prefix import fresh_tail
from prefixreg.sim import SimConfig, SimServer

FAST = 100_000.0  # time compression: a 40k-token cold prefill takes under a millisecond

FLASH_CACHE_KEYS = [
    "entries", "max_entries", "bytes", "last_entry_bytes", "hits", "misses", "stores",
    "evicted", "refused", "prompt_tokens_saved", "store_ms_total", "restore_ms_total",
    "last_store_ms", "last_restore_ms", "rows_copied", "rows_copied_ms", "hit_rate",
]  # fmt: skip
DENSE_CACHE_KEYS = [
    "entries", "bytes", "reserved_bytes", "cap_bytes", "hits", "misses", "stores", "evicted",
    "prompt_tokens_saved", "store_ms_total", "restore_ms_total", "last_store_ms",
    "last_restore_ms", "refused", "hit_rate",
]  # fmt: skip
TIMINGS_KEYS = {
    "prompt_n", "predicted_n", "prompt_ms", "predicted_ms", "prompt_per_second",
    "predicted_per_second", "cache_n", "draft_n", "draft_n_accepted",
}  # fmt: skip


@pytest.fixture
def flash() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=FAST)) as sim:
        yield sim


@pytest.fixture
def dense() -> Iterator[SimServer]:
    with SimServer(SimConfig.for_profile("dense", speed=FAST)) as sim:
        yield sim


def client(sim: SimServer, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=sim.url, trust_env=False, timeout=30, **kw)


def chat_body(system: str, tail: str | None = None, **kw: Any) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": tail if tail is not None else fresh_tail()},
    ]
    return {"model": "anything", "messages": messages, **kw}


def sse_frames(text: str) -> tuple[list[dict[str, Any]], list[str], bool]:
    """(data frames, comment lines, saw [DONE])."""
    frames: list[dict[str, Any]] = []
    comments: list[str] = []
    done = False
    for line in text.split("\n"):
        if line.startswith(":"):
            comments.append(line)
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            assert not done, "a frame after [DONE]"
            frames.append(json.loads(line[len("data: ") :]))
        else:
            assert line == "", line
    return frames, comments, done


def assert_error(resp: httpx.Response, status: int, type_: str, code: str | None) -> str:
    assert resp.status_code == status
    body = resp.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    assert body["error"]["param"] is None
    assert body["error"]["code"] == code
    message = body["error"]["message"]
    assert isinstance(message, str)
    return message


# -- /health, /cache, /v1/models ------------------------------------------------------------


def test_flash_health_reports_the_measured_lane(flash: SimServer) -> None:
    with client(flash) as c:
        h = c.get("/health").json()
    assert h["status"] == "ok"
    assert h["prompt_cache"] == {
        "enabled": True,
        "cap_mb": 110,
        "mode": 2,
        "snapshot_align": 0,
        "bitwise_identical_to_cold": False,
    }
    assert (h["slots"], h["slot_ctx"], h["context"]) == (4, 262144, 262144)
    assert h["version"] == {"api": "0.7.0", "engine": "0.7.0", "match": True}
    assert h["cache_counters"] == "/cache"
    assert len(h["chat_template"]["sha256"]) == 64
    assert (h["busy"], h["in_flight"], h["queued"], h["busy_for_s"]) == (False, 0, 0, 0.0)
    assert h["token_budget_aliases"] == ["max_tokens", "max_completion_tokens", "max_output_tokens"]
    assert (h["max_tokens_default"], h["max_tokens_cap"]) == (8192, 65536)
    assert h["max_tokens_over_cap"] == "400"
    assert h["error_format"] == "openai"


def test_dense_health_has_dense_shape(dense: SimServer) -> None:
    with client(dense) as c:
        h = c.get("/health").json()
    assert "version" not in h
    assert "cache_counters" not in h
    assert set(h["prompt_cache"]) == {
        "enabled",
        "cap_mb",
        "snapshot_align",
        "bitwise_identical_to_cold",
    }
    assert h["prompt_cache"]["snapshot_align"] == 2048
    assert h["prompt_cache"]["bitwise_identical_to_cold"] is True
    assert h["slots"] == 1


def test_cache_field_names_and_initial_values(flash: SimServer, dense: SimServer) -> None:
    with client(flash) as c:
        body = c.get("/cache").json()
    assert list(body) == FLASH_CACHE_KEYS
    assert (body["entries"], body["max_entries"], body["refused"]) == (0, 8, 0)
    assert body["hit_rate"] is None
    with client(dense) as c:
        assert list(c.get("/cache").json()) == DENSE_CACHE_KEYS


def test_models_lists_one_model(flash: SimServer) -> None:
    with client(flash) as c:
        body = c.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["prefixreg-sim-flash"]


def test_request_log_shows_no_chat_for_read_only_calls(flash: SimServer) -> None:
    with client(flash) as c:
        c.get("/health")
        c.get("/cache")
        assert not any(r.method == "POST" for r in flash.requests())
        c.post("/v1/chat/completions", json=chat_body("x"))
    assert [tuple(r) for r in flash.requests()] == [
        ("GET", "/health"),
        ("GET", "/cache"),
        ("POST", "/v1/chat/completions"),
    ]


def test_binds_loopback_by_default() -> None:
    assert SimConfig().host == "127.0.0.1"
    with SimServer(SimConfig(speed=FAST)) as sim:
        assert sim.host == "127.0.0.1"
        assert sim.url == f"http://127.0.0.1:{sim.port}"


# -- completions: non-streaming ---------------------------------------------------------------


def test_cold_usage_omits_cached_tokens_and_timings_keep_cache_n(flash: SimServer) -> None:
    with client(flash) as c:
        body = c.post("/v1/chat/completions", json=chat_body("cold")).json()
    assert list(body)[:5] == ["id", "created", "model", "object", "choices"]
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) == len("chatcmpl-") + 24
    assert body["object"] == "chat.completion"
    assert body["model"] == "prefixreg-sim-flash"  # the server's id, not the request's
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert set(body["timings"]) == TIMINGS_KEYS
    assert body["timings"]["cache_n"] == 0
    assert body["timings"]["prompt_n"] == body["usage"]["prompt_tokens"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 24


def test_warm_usage_reports_cached_tokens(flash: SimServer) -> None:
    req = chat_body("warm me", "a fixed tail")
    with client(flash) as c:
        c.post("/v1/chat/completions", json=req)
        body = c.post("/v1/chat/completions", json=req).json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == body["usage"]["prompt_tokens"] - 7
    assert body["timings"]["cache_n"] == cached
    assert body["timings"]["prompt_n"] == 7


def test_dense_has_no_timings_and_aligned_counts(dense: SimServer) -> None:
    big = " ".join(f"w{i}" for i in range(5000))
    with client(dense) as c:
        short = chat_body("short prompt", "tail")
        for _ in range(2):
            body = c.post("/v1/chat/completions", json=short).json()
            assert "timings" not in body
            assert "prompt_tokens_details" not in body["usage"]  # under 2048: never hits
        req = chat_body(big, "tail")
        c.post("/v1/chat/completions", json=req)
        body = c.post("/v1/chat/completions", json=req).json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 2048 == 0
    assert 0 < cached < body["usage"]["prompt_tokens"]


def test_output_is_deterministic_and_max_tokens_truncates(flash: SimServer) -> None:
    req = chat_body("same", "same tail")
    with client(flash) as c:
        a = c.post("/v1/chat/completions", json=req).json()
        b = c.post("/v1/chat/completions", json=req).json()
        short = c.post("/v1/chat/completions", json={**req, "max_tokens": 3}).json()
        other = c.post("/v1/chat/completions", json=chat_body("different", "tail")).json()
    text = a["choices"][0]["message"]["content"]
    assert text == b["choices"][0]["message"]["content"]
    assert text != other["choices"][0]["message"]["content"]
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["usage"]["completion_tokens"] == 3
    assert text.startswith(short["choices"][0]["message"]["content"])


def test_text_completions_route(flash: SimServer) -> None:
    with client(flash) as c:
        body = c.post("/v1/completions", json={"prompt": "count the words"}).json()
        bad = c.post("/v1/completions", json={"prompt": [1, 2, 3]})
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["prompt_tokens"] == 3
    assert_error(bad, 400, "invalid_request_error", None)


# -- streaming ------------------------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_shape(flash: SimServer, include_usage: bool) -> None:
    req = chat_body("stream", "tail")
    with client(flash) as c:
        plain = c.post("/v1/chat/completions", json=req).json()
        options = {"include_usage": include_usage}
        resp = c.post(
            "/v1/chat/completions", json={**req, "stream": True, "stream_options": options}
        )
    assert resp.headers["content-type"].startswith("text/event-stream")
    frames, _, done = sse_frames(resp.text)
    assert done
    content = [f for f in frames if f["choices"] and f["choices"][0]["finish_reason"] is None]
    finish = [f for f in frames if f["choices"] and f["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    assert finish[0]["choices"][0]["delta"] == {}
    assert finish[0]["timings"]["cache_n"] == plain["usage"]["prompt_tokens"] - 7
    assert all(f["object"] == "chat.completion.chunk" for f in frames)
    assert len({f["id"] for f in frames}) == 1
    text = "".join(f["choices"][0]["delta"]["content"] for f in content)
    assert text == plain["choices"][0]["message"]["content"]
    if include_usage:
        *earlier, last = frames
        assert last["choices"] == []
        usage = last["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 7
        assert all("usage" in f and f["usage"] is None for f in earlier)
    else:
        assert all("usage" not in f for f in frames)


def test_cold_stream_usage_omits_cached_tokens(flash: SimServer) -> None:
    req = chat_body("cold stream", stream=True, stream_options={"include_usage": True})
    with client(flash) as c:
        frames, _, done = sse_frames(c.post("/v1/chat/completions", json=req).text)
    assert done
    assert "prompt_tokens_details" not in frames[-1]["usage"]


def test_completions_stream_frames_carry_text(flash: SimServer) -> None:
    body = {"prompt": "p q r", "stream": True, "stream_options": {"include_usage": True}}
    with client(flash) as c:
        frames, _, done = sse_frames(c.post("/v1/completions", json=body).text)
    assert done
    assert all(f["object"] == "text_completion" for f in frames)
    assert frames[-2]["choices"][0]["text"] == ""
    assert frames[-2]["choices"][0]["finish_reason"] == "stop"
    assert frames[-1]["usage"]["completion_tokens"] == len(frames) - 2


def test_keepalive_comments_during_a_long_prefill() -> None:
    # A prompt of P tokens at 2000 tok/s, no setup: P / 2000 s of prefill (~0.3 s); a
    # keepalive every 0.05 s of silence.
    config = SimConfig(prefill_tps=2000, prefill_setup_s=0, decode_tps=100_000, keepalive=0.05)
    req = chat_body(" ".join(["word"] * 600), "t", stream=True)  # a word is a token
    with SimServer(config) as sim, client(sim) as c:
        frames, comments, done = sse_frames(c.post("/v1/chat/completions", json=req).text)
    assert done
    prompt_n = frames[-1]["timings"]["prompt_n"]
    assert frames[-1]["timings"]["prompt_ms"] == pytest.approx(prompt_n / 2000 * 1000, rel=1e-3)
    assert 0.25 <= prompt_n / 2000 <= 0.35
    assert comments and set(comments) == {": keepalive"}
    assert 4 <= len(comments) <= 6
    with SimServer(dataclasses.replace(config, keepalive=0)) as sim, client(sim) as c:
        _, comments, _ = sse_frames(c.post("/v1/chat/completions", json=req).text)
    assert comments == []


# -- errors ---------------------------------------------------------------------------------


def test_over_cap_is_400(flash: SimServer) -> None:
    with client(flash) as c:
        resp = c.post("/v1/chat/completions", json=chat_body("x", max_tokens=65537))
        ok = c.post("/v1/chat/completions", json=chat_body("x", max_tokens=65536))
    message = assert_error(resp, 400, "invalid_request_error", None)
    assert "65537" in message and "65536" in message
    assert ok.status_code == 200


def test_conflicting_budget_aliases_are_400_agreeing_ones_are_fine(flash: SimServer) -> None:
    with client(flash) as c:
        bad = c.post(
            "/v1/chat/completions",
            json=chat_body("x", max_tokens=10, max_completion_tokens=20),
        )
        same = c.post(
            "/v1/chat/completions",
            json=chat_body("x", max_tokens=5, max_output_tokens=5),
        )
    assert "conflicting token budgets" in assert_error(bad, 400, "invalid_request_error", None)
    assert same.status_code == 200
    assert same.json()["usage"]["completion_tokens"] == 5


def test_prompt_longer_than_slot_ctx_is_400() -> None:
    with SimServer(SimConfig(slot_ctx=100, speed=FAST)) as sim, client(sim) as c:
        resp = c.post("/v1/chat/completions", json=chat_body("w " * 200))
        ok = c.post("/v1/chat/completions", json=chat_body("short"))
    assert "slot" in assert_error(resp, 400, "invalid_request_error", None)
    assert ok.status_code == 200


def test_malformed_requests_are_400_not_422(flash: SimServer) -> None:
    with client(flash) as c:
        for body in (
            b"not json",
            b"[]",
            json.dumps({"messages": []}).encode(),
            json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
            json.dumps({**chat_body("x"), "temperature": 3}).encode(),
            json.dumps({**chat_body("x"), "stream": "yes"}).encode(),
            json.dumps({**chat_body("x"), "max_tokens": True}).encode(),
            b"[" * 100_000,  # nested past any parser's stack: a 400, not a dropped connection
            json.dumps({**chat_body("x"), "temperature": float("nan")}).encode(),
        ):
            resp = c.post("/v1/chat/completions", content=body)
            assert_error(resp, 400, "invalid_request_error", None)


def test_unknown_route_is_404(flash: SimServer) -> None:
    with client(flash) as c:
        assert_error(c.get("/slots"), 404, "not_found_error", None)


def test_api_key_is_required_when_set() -> None:
    config = SimConfig(api_key="s3cret-key", speed=FAST)
    assert "s3cret-key" not in repr(config)
    with SimServer(config) as sim:
        with client(sim) as c:
            assert c.get("/health").status_code == 200  # liveness stays open
            missing = c.post("/v1/chat/completions", json=chat_body("x"))
            assert_error(missing, 401, "authentication_error", None)
            assert_error(c.get("/cache"), 401, "authentication_error", None)
        wrong = {"Authorization": "Bearer nope"}
        with client(sim, headers=wrong) as c:
            resp = c.post("/v1/chat/completions", json=chat_body("x"))
            assert "s3cret-key" not in assert_error(resp, 401, "authentication_error", None)
        right = {"Authorization": "Bearer s3cret-key"}
        with client(sim, headers=right) as c:
            assert c.post("/v1/chat/completions", json=chat_body("x")).status_code == 200
            assert c.get("/cache").status_code == 200

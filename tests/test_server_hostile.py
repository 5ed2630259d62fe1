"""A hostile or broken worker never hangs, floods or fools the client (issue 13).

Every case runs against a real loopback server (`tests.fakeserver`) that trickles, floods,
lies about lengths or sends malformed bodies. Times are bounds with slack, never exact.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixreg.core.errors import ReplyTooLargeError, UsageError, WorkerError, WorkerTimeoutError
from prefixreg.registry.store import Registry
from prefixreg.server.activity import PromptCounter
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.transport import DEFAULT_MAX_BYTES, MAX_SECONDS
from prefixreg.server.worker import Worker
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, lazy, sse_flood, sse_frames
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH, PREFIX, stream_reply

CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
GIB = 1024 * MIB
SLACK = 1.0  # the deadline may be overrun by at most this much


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer() as srv:
        yield srv


@pytest.fixture
def reg_path(tmp_path: Path) -> Path:
    path = tmp_path / "reg"
    Registry(path).add("You are a careful assistant. " * 20, name="loop")
    return path


def timed(fn: Callable[[], object]) -> tuple[BaseException | None, float]:
    started = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 -- returned to the test to assert on
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


# ------------------------------------------------------------------ deadlines


def test_trickled_health_body_is_cut_at_the_deadline(server: FakeServer) -> None:
    """One byte every 50 ms: each read succeeds, the whole call would take ~30 s."""
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH, trickle=0.05))
    with Worker(server.url, timeout=1.0) as w:
        exc, took = timed(w.health)
    assert isinstance(exc, WorkerTimeoutError), exc
    assert "timed out" in str(exc) and "/health" in str(exc)
    assert took < 1.0 + SLACK


def test_trickled_headers_are_cut_at_the_deadline(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH, trickle_head=True))
    with Worker(server.url, timeout=1.0) as w:
        exc, took = timed(w.health)
    assert isinstance(exc, WorkerTimeoutError), exc
    assert took < 1.0 + SLACK


def test_trickled_stream_is_cut_at_the_deadline(server: FakeServer) -> None:
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply()), trickle=0.05))
    with Worker(server.url, read_timeout=1.5) as w:
        exc, took = timed(lambda: w.chat(PREFIX, "t"))
    assert isinstance(exc, WorkerTimeoutError), exc
    assert took < 1.5 + SLACK


def test_a_stream_that_goes_silent_is_cut_at_the_deadline(server: FakeServer) -> None:
    frames = sse_frames(stream_reply())
    server.route("POST", CHAT, Reply(sse=frames, piece_delay=30))
    with Worker(server.url, read_timeout=1.0) as w:
        exc, took = timed(lambda: w.chat(PREFIX, "t"))
    assert isinstance(exc, WorkerTimeoutError), exc
    assert took < 1.0 + SLACK


def test_small_routes_never_wait_longer_than_the_chat_deadline(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH, trickle=0.05))
    with Worker(server.url, timeout=30.0, read_timeout=1.0) as w:
        exc, took = timed(w.health)
    assert isinstance(exc, WorkerTimeoutError) and took < 1.0 + SLACK


def test_a_slow_but_whole_reply_within_the_deadline_is_read(server: FakeServer) -> None:
    server.route("POST", CHAT, Reply(sse=sse_frames(stream_reply()), piece_delay=0.05))
    with Worker(server.url, read_timeout=10.0) as w:
        _, ev = w.chat(PREFIX, "t")
    assert ev.cache_state == "reused" and ev.complete


def test_warm_against_a_trickling_health_exits_5_near_its_timeout(
    server: FakeServer, reg_path: Path
) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH, trickle=0.05))
    started = time.monotonic()
    res = run_cli(
        "warm", "loop", "--worker", server.url, "--registry", str(reg_path), "--timeout", "1"
    )
    took = time.monotonic() - started
    assert res.returncode == 5, res.stderr
    assert b"timed out" in res.stderr and b"Traceback" not in res.stderr
    assert took < 15  # the trickle alone lasts ~30 s; the rest is interpreter start-up


# ------------------------------------------------------------------ timeouts at the boundary


@pytest.mark.parametrize(
    "bad", [math.inf, math.nan, 1e300, 0, -1, MAX_SECONDS + 1, True, "5", None]
)
def test_worker_timeouts_are_validated(bad: Any) -> None:
    for name in ("timeout", "read_timeout"):
        with pytest.raises(UsageError, match=name):
            Worker("http://127.0.0.1:9", **{name: bad})


@pytest.mark.parametrize("bad", [0, 1023, 2.5, True, "64", 1 << 41])
def test_reply_cap_is_validated(bad: Any) -> None:
    with pytest.raises(UsageError, match="max_bytes"):
        Worker("http://127.0.0.1:9", max_bytes=bad)


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "-inf"])
def test_warm_timeout_that_is_not_a_sane_number_is_a_usage_error(
    reg_path: Path, value: str
) -> None:
    res = run_cli(
        "warm", "loop", "--worker", "http://127.0.0.1:9", "--registry", str(reg_path),
        "--timeout", value,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert b"Traceback" not in res.stderr


# ------------------------------------------------------------------ size caps


def test_default_reply_cap_is_64_mib() -> None:
    assert DEFAULT_MAX_BYTES == 64 * MIB
    with Worker("http://127.0.0.1:9") as w:
        assert w.max_bytes == DEFAULT_MAX_BYTES


@pytest.mark.parametrize(
    ("method", "path", "reply"),
    [
        ("GET", "/health", Reply(generate=lazy(GIB), content_type="application/json")),
        ("GET", "/cache", Reply(generate=lazy(GIB), content_type="application/json")),
        ("GET", "/metrics", Reply(generate=lazy(GIB), content_type="text/plain")),
        ("POST", CHAT, Reply(generate=sse_flood(GIB), content_type="text/event-stream")),
        ("POST", CHAT, Reply(generate=lazy(GIB), content_type="application/json")),
    ],
)
def test_a_reply_over_the_cap_is_a_worker_error(
    server: FakeServer, method: str, path: str, reply: Reply
) -> None:
    server.route(method, path, reply)
    calls: dict[str, Callable[[Worker], object]] = {
        "/health": Worker.health,
        "/cache": Worker.cache,
        "/metrics": Worker.metrics,
        CHAT: lambda w: w.chat(PREFIX, "t"),
    }
    with Worker(server.url, max_bytes=2 * MIB) as w:
        exc, _ = timed(lambda: calls[path](w))
    assert isinstance(exc, ReplyTooLargeError) and isinstance(exc, WorkerError), exc
    assert "2 MiB cap" in str(exc)


def test_the_default_cap_stops_a_flood(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(generate=lazy(GIB), content_type="application/json"))
    with Worker(server.url) as w, pytest.raises(ReplyTooLargeError, match="64 MiB"):
        w.health()


def test_an_announced_length_over_the_cap_is_refused_before_reading(server: FakeServer) -> None:
    server.route("GET", "/health", Reply(generate=lazy(GIB), length=100 * GIB))
    with Worker(server.url, max_bytes=MIB) as w:
        exc, took = timed(w.health)
    assert isinstance(exc, ReplyTooLargeError)
    assert took < 5


def test_a_reply_just_under_the_cap_is_read(server: FakeServer) -> None:
    body = json.dumps({"status": "ok", "pad": "z" * (MIB - 100)}).encode()
    server.route("GET", "/health", Reply(body=body, content_type="application/json"))
    with Worker(server.url, max_bytes=MIB) as w:
        assert w.health()["status"] == "ok"


def _child_peak_rss(args: list[str]) -> tuple[int, int]:
    """(exit code, peak RSS in bytes) of `python -m prefixreg ARGS`, measured by a parent
    process of its own so no other child's peak is mixed in."""
    probe = (
        "import resource, subprocess, sys\n"
        "r = subprocess.run([sys.executable, '-m', 'prefixreg', *sys.argv[1:]],"
        " capture_output=True)\n"
        "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *args], capture_output=True, timeout=120, check=True
    )
    code, kib = out.stdout.split()
    return int(code), int(kib) * 1024


@pytest.mark.parametrize("kind", ["sse", "json"])
def test_warm_against_a_1_gib_reply_stays_under_cap_plus_100_mib(
    server: FakeServer, reg_path: Path, kind: str
) -> None:
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
    server.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
    flood = sse_flood(GIB) if kind == "sse" else lazy(GIB)
    ctype = "text/event-stream" if kind == "sse" else "application/json"
    server.route("POST", CHAT, Reply(generate=flood, content_type=ctype))
    code, peak = _child_peak_rss(
        ["warm", "loop", "--worker", server.url, "--registry", str(reg_path)]
    )
    assert code == 5
    assert peak < DEFAULT_MAX_BYTES + 100 * MIB, f"peak RSS {peak / MIB:.0f} MiB"


# ------------------------------------------------------------------ verdicts


def test_one_mid_stream_chunk_is_never_cold(server: FakeServer) -> None:
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}],
        "usage": {
            "prompt_tokens": 45,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    ev = evidence_from_response(chunk)
    assert (ev.cache_state, ev.complete, ev.output_sha256) == ("unverified", False, None)
    server.route("POST", CHAT, Reply(json=chunk))
    with Worker(server.url) as w:
        _, streamed = w.chat(PREFIX, "t")  # a JSON body where a stream was asked for
        _, plain = w.chat(PREFIX, "t", stream=False)
    for got in (streamed, plain):
        assert (got.cache_state, got.complete, got.error) == (
            "unverified",
            False,
            "incomplete_response",
        )


@pytest.mark.parametrize(
    "body", [b"not json", b"[1, 2]", b'{"usage": {"prompt_tokens": 8}}', b'{"choices": [}']
)
def test_warm_records_a_malformed_chat_body_and_exits_4(
    server: FakeServer, reg_path: Path, body: bytes
) -> None:
    """The same fault as in a stream: state unverified, exit 4, and a record of it."""
    server.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
    server.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
    server.route("POST", CHAT, Reply(body=body, content_type="application/json"))
    res = run_cli("warm", "loop", "--worker", server.url, "--registry", str(reg_path), "--json")
    assert res.returncode == 4, res.stderr
    receipt = json.loads(res.stdout)
    assert receipt["body"]["verdict"] == "unverified"
    assert Path(receipt["record"]).is_file()
    for call in receipt["body"]["calls"]:
        assert call["evidence"]["cache_state"] == "unverified"
        assert call["evidence"]["error"] in ("malformed_response", "incomplete_response")


def test_a_truncated_stream_and_a_truncated_body_give_the_same_state(server: FakeServer) -> None:
    whole = json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {}}]})
    server.route(
        "POST",
        CHAT,
        Reply(sse=sse_frames(stream_reply(), done=False)),
        Reply(body=whole.encode(), content_type="application/json", truncate_at=20),
    )
    with Worker(server.url) as w:
        _, cut_stream = w.chat(PREFIX, "t")
        _, cut_body = w.chat(PREFIX, "t", stream=False)
    assert cut_stream.cache_state == cut_body.cache_state == "unverified"
    assert not cut_stream.complete and not cut_body.complete


# ------------------------------------------------------------------ activity counters (#22)


@pytest.mark.parametrize("busy", ["yes", 1, None, [True]])
def test_slots_with_a_malformed_is_processing_give_no_count(server: FakeServer, busy: Any) -> None:
    slots = [{"id": 0, "id_task": 5, "is_processing": busy}]
    server.route("GET", "/slots", Reply(json=slots))
    with Worker(server.url) as w:
        assert PromptCounter(w, "/slots").read() is None  # never read as idle


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_metrics_with_a_counter_that_is_not_finite_give_no_count(
    server: FakeServer, value: str
) -> None:
    text = f"llamacpp:prompt_tokens_total {value}\nllamacpp:prompt_tokens_cached_total 3\n"
    server.route("GET", "/metrics", Reply(body=text.encode(), content_type="text/plain"))
    with Worker(server.url) as w:
        assert PromptCounter(w, "/metrics").read() is None

"""`qualify` against a scripted loopback server (`tests.fakeserver`): hostile and odd replies,
each rule of the strict evidence, and the concurrent group really overlapping on the wire."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.errors import WorkerError
from prefixreg.server.worker import Worker
from prefixreg.verbs.qualify.run import QualifyResult, qualify
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request, sse_frames

ROUTE = "/v1/completions"
SECRET = "engine exploded at /srv/secret-model.gguf"


def text_frame(piece: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": piece, "finish_reason": None}]}


def reasoning_frame(piece: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"reasoning_content": piece}, "finish_reason": None}]}


def usage_frame(
    *, prompt: Any = 40, cached: Any = 0, completion: Any = 4, token_sha: str | None = None
) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    if cached is not ...:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    out: dict[str, Any] = {"choices": [], "usage": usage}
    return out | ({"tensorfold": {"token_sha": token_sha}} if token_sha else {})


def reply(pieces: list[Any] | None = None, *, done: bool = True, **usage: Any) -> Reply:
    frames = [text_frame(p) if isinstance(p, str) else p for p in pieces or ["four"]]
    return Reply(sse=sse_frames([*frames, usage_frame(**usage)], done=done))


def run(srv: FakeServer, **kwargs: Any) -> QualifyResult:
    with Worker(srv.url) as w:
        return qualify(w, **kwargs)


def test_first_then_repeats_then_concurrent_identical_bodies_no_warmup() -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(cached=0), reply(cached=39))
        result = run(srv, repeats=1, streams=3, require_cold=True, require_reuse=True)
        bodies = [r.body for r in srv.requests if r.path == ROUTE]
    assert result.qualified, result.failures
    assert len(bodies) == 5 and len(set(bodies)) == 1  # one body, sent five times
    sent = json.loads(bodies[0])
    assert sent["temperature"] == 0 and sent["seed"] == 1234 and sent["max_tokens"] == 64
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert [r.phase for r in result.rows] == ["first", "repeated", *["concurrent"] * 3]
    assert [r.evidence.cache_state for r in result.rows] == ["cold", *["reused"] * 4]


def test_the_concurrent_group_is_in_flight_together_on_the_wire() -> None:
    streams = 4
    barrier = threading.Barrier(streams, timeout=20)
    seen = {"n": 0}
    lock = threading.Lock()

    def script(_req: Request) -> Reply:
        with lock:
            seen["n"] += 1
            index = seen["n"]
        if index > 2:  # the concurrent group: each waits until all are being served
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                return Reply(status=500, json={"error": {"message": "not overlapping"}})
        return reply(cached=0 if index == 1 else 39)

    with FakeServer() as srv:
        srv.route("POST", ROUTE, script)
        result = run(srv, repeats=1, streams=streams)
    assert result.qualified, result.failures
    assert not barrier.broken
    assert [r.evidence.complete for r in result.rows] == [True] * (2 + streams)


def test_concurrent_rows_keep_each_requests_own_evidence_in_request_order() -> None:
    lock, count = threading.Lock(), [0]

    def script(_req: Request) -> Reply:
        with lock:
            count[0] += 1
            n = count[0]
        # each reply its own completion count, later arrivals answered sooner
        return Reply(
            sse=sse_frames([text_frame("x"), usage_frame(cached=0, completion=n)]),
            delay=0.05 * (8 - n) if n > 1 else 0,
        )

    with FakeServer() as srv:
        srv.route("POST", ROUTE, script)
        result = run(srv, repeats=1, streams=5)
    rows = result.receipt["rows"]
    assert [r["request"] for r in rows] == list(range(1, 8))
    assert [r["phase"] for r in rows] == ["first", "repeated", *["concurrent"] * 5]
    assert rows[0]["completion_tokens"] == 1 and rows[1]["completion_tokens"] == 2
    assert sorted(r["completion_tokens"] for r in rows[2:]) == [3, 4, 5, 6, 7]  # none lost


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("cached", True, "a boolean"),
        ("cached", False, "a boolean"),
        ("cached", -1, "negative"),
        ("cached", "0", "a string"),
        ("cached", 0.0, "a float"),
        ("prompt", 40.0, "a float"),
        ("prompt", "40", "a string"),
        ("prompt", True, "a boolean"),
        ("prompt", -40, "negative"),
    ],
)
def test_malformed_counts_are_unverified_never_cold(field: str, value: Any, why: str) -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(**{field: value}))
        result = run(srv, repeats=1, streams=1, require_cold=True)
    first = result.rows[0].evidence
    assert first.cache_state == "unverified"
    assert first.reason is not None and why in first.reason
    assert not result.qualified
    assert "--require-cold" in result.failures[0]


def test_a_cold_reply_that_omits_the_count_is_not_cold() -> None:
    """Halogen omits `prompt_tokens_details` when nothing was cached: not a zero."""
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(cached=...), reply(cached=32))
        result = run(srv, repeats=1, streams=1, require_cold=True)
    assert result.rows[0].evidence.cache_state == "unverified"
    assert not result.qualified


def test_truncated_stream_gives_no_fingerprint_rate_or_qualification() -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(token_sha="a" * 12), reply(done=False, token_sha="a" * 12))
        result = run(srv, repeats=1, streams=1)
    cut = result.rows[1]
    assert cut.evidence.complete is False and cut.evidence.error == "incomplete_stream"
    assert cut.evidence.output_sha256 is None and cut.evidence.token_sha is None
    assert cut.decode_tps is None and cut.evidence.ttft_s is None
    assert cut.tokens_vs_first == "unverified" and cut.output_vs_first == "unverified"
    assert not result.qualified


def test_an_error_frame_fails_the_call_and_its_text_is_not_kept(tmp_path: Path) -> None:
    error = Reply(sse=sse_frames([text_frame("par"), {"error": {"message": SECRET}}]))
    out = tmp_path / "r.json"
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(), error)
        res = run_cli("qualify", "--worker", srv.url, "--output", str(out), "--repeats", "1")
    assert res.returncode == 1, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["rows"][1]["error"] == "server_stream_error"
    assert "secret" not in out.read_text() and "exploded" not in out.read_text()


def test_missing_token_hashes_on_one_or_both_sides_are_unverified() -> None:
    a, b = "a" * 12, "b" * 64
    with FakeServer() as srv:
        srv.route(
            "POST", ROUTE, reply(token_sha=a), reply(), reply(token_sha=a), reply(token_sha=b)
        )
        result = run(srv, repeats=3, streams=1)
    tokens = [r.tokens_vs_first for r in result.rows[1:]]
    assert tokens[:3] == ["unverified", "pass", "differ"]
    assert not result.qualified and "token fingerprint differs" in result.failures[0]
    with FakeServer() as srv:  # no hash on either side: unverified, and that is no failure
        srv.route("POST", ROUTE, reply())
        none = run(srv, repeats=1, streams=1)
    assert [r.tokens_vs_first for r in none.rows[1:]] == ["unverified", "unverified"]
    assert none.qualified and none.receipt["counts"]["tokens_pass"] == 0


def test_unicode_split_across_chunks_and_wire_pieces_is_the_same_output() -> None:
    whole = "data: " + json.dumps(text_frame("café 🚀"), ensure_ascii=False) + "\n\n"
    raw = whole.encode("utf-8")
    cut = raw.index("🚀".encode()) + 1  # the wire piece ends inside the character
    split_frames = [text_frame("caf"), text_frame("é "), text_frame("🚀")]
    with FakeServer() as srv:
        srv.route(
            "POST",
            ROUTE,
            Reply(sse=[raw[:cut], raw[cut:], *sse_frames([usage_frame()])], piece_delay=0.01),
            reply(split_frames),
        )
        result = run(srv, repeats=1, streams=1)
    assert all(r.evidence.complete for r in result.rows)
    assert [r.output_vs_first for r in result.rows[1:]] == ["pass", "pass"]
    assert result.qualified, result.failures


def test_reasoning_only_output_is_output_and_differs_from_the_same_text_as_content() -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply([reasoning_frame("let me think")]))
        result = run(srv, repeats=1, streams=1)
    assert result.qualified, result.failures
    assert result.rows[0].evidence.output_sha256 is not None
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply([reasoning_frame("same")]), reply(["same"]))
        swapped = run(srv, repeats=1, streams=1)
    assert swapped.rows[1].output_vs_first == "differ" and not swapped.qualified


def test_no_completion_tokens_or_no_output_is_not_qualified() -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(completion=0))
        assert not run(srv, repeats=1, streams=1).qualified
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(completion=None))
        result = run(srv, repeats=1, streams=1)
    assert not result.qualified and "counted no completion tokens" in result.failures[0]


def test_a_later_request_that_fails_is_a_row_naming_its_class_only(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply(), Reply(hangup=True), reply())
        res = run_cli("qualify", "--worker", srv.url, "--output", str(out), "--repeats", "1")
        url = srv.url
    assert res.returncode == 1, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["rows"][1]["error"] == "WorkerUnreachableError"
    assert receipt["rows"][1]["cache_state"] == "unverified"
    assert url not in out.read_text() and "127.0.0.1" not in out.read_text()


def test_a_first_request_refused_is_exit_5_with_the_receipt(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    refused = Reply(status=400, json={"error": {"message": "prompt must be a string"}})
    ids = tmp_path / "ids.json"
    ids.write_text("[1, 2, 3]")
    with FakeServer() as srv:
        srv.route("POST", ROUTE, refused)
        args = ["--worker", srv.url, "--output", str(out), "--prompt-file", str(ids)]
        res = run_cli("qualify", *args)
        assert sum(1 for r in srv.requests if r.path == ROUTE) == 1
    assert res.returncode == 5, res.stderr
    assert b"prompt must be a string" in res.stderr  # the server's own word, on stderr only
    assert b"hint: this engine may not take a token-ID prompt" in res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["error"] == "WorkerHTTPError" and receipt["qualified"] is False
    assert "must be a string" not in out.read_text()
    with FakeServer() as srv, pytest.raises(WorkerError):
        srv.route("POST", ROUTE, refused)
        run(srv)


def test_a_reply_with_no_text_is_not_qualified_whatever_its_count() -> None:
    with FakeServer() as srv:
        srv.route("POST", ROUTE, reply([""], completion=4))
        result = run(srv, repeats=1, streams=1)
    assert not result.qualified and "no output text" in result.failures[0]
    assert result.rows[0].decode_tps is None  # no piece of text: no first-token time either


@pytest.mark.parametrize("prompt", [[], [True], [1.0], ["1"], [-1], [1 << 32], 7, None, ""])
def test_complete_refuses_what_is_not_a_prompt_before_sending(prompt: Any) -> None:
    from prefixreg.core.errors import UsageError

    with FakeServer() as srv, Worker(srv.url) as w:
        with pytest.raises(UsageError):
            w.complete(prompt)
        with pytest.raises(UsageError):
            w.complete("text", stream=False)
        assert srv.requests == []


def test_a_build_that_changes_during_the_run_is_not_qualified() -> None:
    with FakeServer() as srv:

        def models(_req: Request) -> Reply:
            served = sum(1 for r in srv.requests if r.path == ROUTE)
            model = "build-a" if served < 3 else "build-b"  # restarted after the last call
            return Reply(json={"object": "list", "data": [{"id": model, "object": "model"}]})

        srv.route("GET", "/v1/models", models)
        srv.route("POST", ROUTE, reply(cached=0), reply(cached=39))
        result = run(srv, repeats=1, streams=1)
    assert all(r.evidence.complete for r in result.rows)
    assert not result.qualified
    assert any("server build changed" in why for why in result.failures)

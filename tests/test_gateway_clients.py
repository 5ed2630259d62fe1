"""Real clients and a real loop through `prefixreg gateway`, against the real llama-server peer,
with only a base-URL change: litellm (streamed and not) and mini-swe-agent (PyPI, through
litellm; `tests.loops`). The gateway's call log holds the server's own counts, call by call
and in total (llama-server's `/metrics` counters), `audit` of it gives the same totals, and
the proof headers reach the client (litellm hands them over as
`_hidden_params["additional_headers"]`, prefixed `llm_provider-`; a stream's proof is
fetched by its `x-prefixreg-call` id).

And a loop whose Anthropic `system[0]` carries a per-request nonce: its first repeated call
names the drift and where, and with `--strip` its cached share comes back to the nonce-free
loop's. (Claude Code's own billing line is named as drift too; llama-server normalizes that
one line itself, so the share is shown with a per-request id it does not know.)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway_peer import serve_gateway
from tests.loops import (
    BILLING,
    REQUEST_ID,
    STRIP,
    LoopCall,
    call_of,
    messages_loop,
    nonce_at,
    run_mini_swe_agent,
)
from tests.peer.llama_peer import PeerServer

pytestmark = [
    pytest.mark.timeout(600),
    # litellm's and pydantic's own deprecation notices are theirs, not ours.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore:Item .* is using the `ReadOnly` qualifier:UserWarning"),
]

SYSTEM = "You are a terse assistant for a test of prompt caching. " * 12


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def proof(call_headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in call_headers.items() if k.startswith("x-prefixreg-")}


@pytest.fixture
def peer(llama_server: PeerServer) -> PeerServer:
    llama_server.erase_slots()  # each test starts cold
    return llama_server


@pytest.fixture
def gateway(peer: PeerServer, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "calls.jsonl"
    with serve_gateway("--worker", peer.url, "--call-log", str(log)) as url:
        yield url, log


def _litellm_call(base: str, messages: list[dict[str, str]], *, stream: bool) -> LoopCall:
    import litellm

    litellm.suppress_debug_info = True
    kwargs: dict[str, Any] = {
        "model": "openai/peer",
        "api_base": base + "/v1",  # the one change: the gateway's base URL
        "api_key": "none",
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "seed": 1,
    }
    if not stream:
        return call_of(litellm.completion(**kwargs))
    chunks = litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True})
    last = None
    for chunk in chunks:
        if getattr(chunk, "usage", None) is not None:
            last = chunk
    assert last is not None, "no usage chunk in the stream"
    return call_of(last, headers_from=chunks)


def _turns() -> list[list[dict[str, str]]]:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say one."}]
    second = [*first, {"role": "assistant", "content": "One."}, {"role": "user", "content": "Two?"}]
    return [first, second]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_litellm_through_the_gateway_gets_proof_and_the_log_holds_the_servers_counts(
    gateway: tuple[str, Path], stream: bool
) -> None:
    url, log = gateway
    calls = [_litellm_call(url, messages, stream=stream) for messages in _turns()]
    lines = read_log(log)
    assert len(lines) == 2
    for call, line in zip(calls, lines, strict=True):
        assert line["evidence"]["prompt_tokens"] == call.prompt_tokens
        assert line["evidence"]["cached_tokens"] == call.cached_tokens
        assert line["gateway"]["streamed"] is stream
        headers = proof(dict(call.headers))
        assert headers["x-prefixreg-head"] == hashlib.sha256(SYSTEM.encode()).hexdigest()
        assert headers["x-prefixreg-call"] == line["gateway"]["call"]
        if stream:  # its headers went out before the server counted: the proof is by its id
            got = httpx.get(f"{url}/prefixreg/calls/{headers['x-prefixreg-call']}").json()
            assert got["evidence"]["cached_tokens"] == call.cached_tokens
            assert got["gateway"]["verdict"] == line["gateway"]["verdict"]
        else:
            assert headers["x-prefixreg-cached"] == str(call.cached_tokens)
            assert headers["x-prefixreg-verdict"] == line["gateway"]["verdict"]
    assert calls[0].cached_tokens < calls[1].cached_tokens  # the second call resumed the first
    assert lines[0]["gateway"]["session"] == lines[1]["gateway"]["session"]


def _server_totals(server: PeerServer) -> tuple[int, int]:
    """(prompt, cached) tokens llama-server has counted so far, from its own /metrics."""
    m = server.metrics()
    uncached, cached = m["llamacpp:prompt_tokens_total"], m["llamacpp:prompt_tokens_cached_total"]
    return int(uncached + cached), int(cached)


def test_mini_swe_agent_through_the_gateway_and_the_call_log_and_audit_hold_the_servers_counts(
    gateway: tuple[str, Path], peer: PeerServer
) -> None:
    url, log = gateway
    before = _server_totals(peer)
    run = run_mini_swe_agent(url, steps=3, max_tokens=8)  # the one change: the base URL
    after = _server_totals(peer)
    assert run.exit_status == "LimitsExceeded"  # it ran its 3 steps, nothing failed
    assert len(run.calls) == 3
    lines = read_log(log)
    assert [(ln["evidence"]["prompt_tokens"], ln["evidence"]["cached_tokens"]) for ln in lines] == [
        (c.prompt_tokens, c.cached_tokens) for c in run.calls
    ]
    logged = (
        sum(ln["evidence"]["prompt_tokens"] for ln in lines),
        sum(ln["evidence"]["cached_tokens"] for ln in lines),
    )
    assert logged == (after[0] - before[0], after[1] - before[1])  # the server's own totals
    assert all(proof(dict(c.headers)).get("x-prefixreg-verdict") for c in run.calls)
    assert len({ln["gateway"]["session"] for ln in lines}) == 1  # one session, seen as one
    assert lines[0]["gateway"]["verdict"] == "cold"
    assert all(ln["gateway"]["verdict"] == "resumed" for ln in lines[1:])
    assert run.calls[2].cached_tokens > run.calls[1].cached_tokens > 0  # history resumed
    audit = subprocess.run(
        [sys.executable, "-m", "prefixreg", "audit", str(log), "--json"],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "PREFIXREG_HOME": str(log.parent / "registry")},
    )
    assert audit.returncode == 0, audit.stderr
    tokens = json.loads(audit.stdout)["tokens"]
    assert (tokens["prompt"]["total"], tokens["cached"]["total"]) == logged


# -- a per-request nonce at the head ------------------------------------------------------------


def share(lines: list[dict[str, Any]]) -> float:
    prompt = sum(int(ln["evidence"]["prompt_tokens"]) for ln in lines)
    cached = sum(int(ln["evidence"]["cached_tokens"] or 0) for ln in lines)
    return cached / prompt


def test_a_per_request_nonce_is_named_as_drift_and_strip_recovers_the_share(
    peer: PeerServer, tmp_path: Path
) -> None:
    shares = {}
    for name, nonce, args in (
        ("nonce", True, ()),
        ("strip", True, ("--strip", STRIP)),
        ("plain", False, ()),
    ):
        peer.erase_slots()
        log = tmp_path / f"{name}.jsonl"
        with serve_gateway("--worker", peer.url, "--call-log", str(log), *args) as url:
            replies = messages_loop(url, nonce=nonce, turns=3)
        lines = read_log(log)
        shares[name] = share(lines)
        if name == "nonce":  # the first repeated call names the part and the byte
            drift = replies[1].headers.get("x-prefixreg-drift")
            assert drift == f"system at byte {nonce_at(REQUEST_ID)}"
            sent = json.loads(replies[1].request.content)["system"][0]["text"]
            nonce = sent[nonce_at(REQUEST_ID) :].split(";")[0]
            assert nonce in replies[1].headers["x-prefixreg-drift-bytes"]  # the bytes, named
            assert lines[1]["gateway"]["drift"]["offset"] == nonce_at(REQUEST_ID)
            assert lines[1]["gateway"]["drift"]["part"] == "system"
        else:
            assert all("x-prefixreg-drift" not in r.headers for r in replies)
        if name == "strip":
            assert all(r.headers.get("x-prefixreg-stripped") == "1" for r in replies)
    assert shares["nonce"] < shares["plain"] - 0.3  # the nonce at the head costs the history
    assert abs(shares["strip"] - shares["plain"]) <= 0.05


def test_claude_codes_billing_nonce_is_named_as_drift_at_its_cch(
    peer: PeerServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.jsonl"
    with serve_gateway("--worker", peer.url, "--call-log", str(log)) as url:
        replies = messages_loop(url, nonce=True, turns=2, line=BILLING)
    assert replies[1].headers.get("x-prefixreg-drift") == f"system at byte {nonce_at(BILLING)}"
    assert "x-prefixreg-drift" not in replies[0].headers

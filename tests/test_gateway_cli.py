"""`prefixreg gateway` as a command: what it refuses before it listens (exit 2, one line),
the client key at the door, the upstream key from the environment and nowhere else, and a
per-request nonce found as drift and stripped until the cache resumes as without it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply
from tests.gateway_peer import serve_gateway

REPLY = {"choices": [{"index": 0, "message": {"content": "k"}, "finish_reason": "stop"}]}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--listen", "0.0.0.0:8740"], "not a loopback address"),
        (["--listen", "0.0.0.0:8740", "--listen-any"], "needs a client key"),
        (["--listen", "nonsense"], "is not HOST:PORT"),
        (["--strip", "(unclosed"], "is not a regex"),
        (["--on-drift", "ignore"], "warn or refuse"),
        (["--client-key-env", "PREFIXREG_TEST_UNSET_KEY"], "the variable is not set"),
    ],
)
def test_bad_arguments_are_refused_before_anything_listens(args: list[str], says: str) -> None:
    done = run_cli("gateway", "--worker", "http://127.0.0.1:9", *args, timeout=30)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr.decode()
    assert b"Traceback" not in done.stderr


def test_a_call_log_that_is_a_directory_or_in_the_registry_is_refused(tmp_path: Path) -> None:
    done = run_cli("gateway", "--worker", "http://127.0.0.1:9", "--call-log", str(tmp_path))
    assert done.returncode == 2 and b"a directory" in done.stderr
    reg = tmp_path / "reg"
    reg.mkdir()
    inside = run_cli(
        "gateway",
        "--worker",
        "http://127.0.0.1:9",
        "--registry",
        str(reg),
        "--call-log",
        str(reg / "calls.jsonl"),
    )
    assert inside.returncode == 2 and b"inside the registry" in inside.stderr
    assert not (reg / "calls.jsonl").exists()


def test_the_client_key_is_checked_and_the_upstream_key_replaces_it() -> None:
    env = {"GW_CLIENT_KEY": "client-secret", "PREFIXREG_API_KEY": "upstream-secret"}
    with FakeServer() as fake:
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY))
        fake.route("GET", "/v1/models", Reply(json={"data": []}))
        with serve_gateway(
            "--worker", fake.url, "--client-key-env", "GW_CLIENT_KEY", env=env
        ) as url:
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            none = httpx.post(url + "/v1/chat/completions", json=body)
            wrong = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
            ok = httpx.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer client-secret"},
            )
            models = httpx.get(url + "/v1/models", headers={"x-api-key": "client-secret"})
        sent = fake.requests
    assert none.status_code == wrong.status_code == 401
    assert none.json()["error"]["code"] == "invalid_api_key"
    assert wrong.json()["type"] == "error"  # Anthropic's shape on its route
    assert ok.status_code == models.status_code == 200
    assert [r.headers.get("authorization") for r in sent] == ["Bearer upstream-secret"] * 2
    assert all("x-api-key" not in r.headers for r in sent)
    assert all("client-secret" not in str(r.headers) for r in sent)


def _share(url: str, system_of: Any, calls: int = 6) -> float:
    prompt = cached = 0
    history: list[dict[str, str]] = [{"role": "user", "content": "the task"}]
    with httpx.Client(base_url=url) as client:
        for i in range(calls):
            body = {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "system", "content": system_of(i)}, *history],
            }
            loop = {"x-session-id": "the-loop"}  # one loop: its head changing is its drift
            usage = client.post("/v1/chat/completions", json=body, headers=loop).json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            history += [
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": f"step {i}"},
            ]
    return cached / prompt


def test_a_nonce_in_the_system_prompt_is_named_and_stripped_until_the_share_recovers() -> None:
    rules = "You are the house coding loop. Keep every change small and tested. " * 40

    def nonce(i: int) -> str:
        return f"request-id: {i:08x}\n" + rules

    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, _),
    ):
        clean = _share(url, lambda i: rules)
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw),
    ):
        drifting = _share(url, nonce)
        drifted = gw.door.metrics.value("drift_total", part="system")
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(
            GatewayConfig(workers=(sim.url,), strip=(r"^request-id: [0-9a-f]+\n",))
        ) as (url, gw),
    ):
        stripped = _share(url, nonce)
        strips = gw.door.metrics.value("strips_total")
    assert drifted == 5  # every repeated call named
    assert drifting < clean - 0.3  # the nonce costs the head
    assert abs(stripped - clean) <= 0.05
    assert strips == 6


def test_without_the_gateway_extra_the_command_names_what_to_install(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "starlette.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'starlette'\", name='starlette')\n"
    )
    import os

    path = os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])
    done = run_cli("gateway", "--worker", "http://127.0.0.1:9", env={"PYTHONPATH": path})
    assert done.returncode == 2
    assert b"starlette is not installed" in done.stderr
    assert b"prefixreg[gateway]" in done.stderr and b"Traceback" not in done.stderr


def test_the_gateways_own_routes_need_the_client_key_too() -> None:
    with FakeServer() as fake:
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY))
        config = GatewayConfig(workers=(fake.url,), client_key="client-secret")
        with serve_in_thread(config) as (url, _):
            key = {"authorization": "Bearer client-secret"}
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            call = httpx.post(url + "/v1/chat/completions", json=body, headers=key)
            paths = [
                "/metrics",
                "/prefixreg/heads",
                "/prefixreg/calls/" + call.headers["x-prefixreg-call"],
            ]
            without = [httpx.get(url + p).status_code for p in paths]
            wrong = [httpx.get(url + p, headers={"x-api-key": "no"}).status_code for p in paths]
            keyed = [httpx.get(url + p, headers=key).status_code for p in paths]
    assert without == wrong == [401, 401, 401]
    assert keyed == [200, 200, 200]


def test_a_cookie_one_reply_sets_is_never_sent_with_another_callers_request() -> None:
    with FakeServer() as fake:
        fake.route(
            "POST",
            "/v1/chat/completions",
            Reply(json=REPLY, headers={"Set-Cookie": "tenant=alice; Path=/"}),
            Reply(json=REPLY),
        )
        with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            first = httpx.post(url + "/v1/chat/completions", json=body)
            second = httpx.post(url + "/v1/chat/completions", json=body)
            own = httpx.post(url + "/v1/chat/completions", json=body, headers={"cookie": "mine=1"})
        sent = fake.requests
    assert first.headers["set-cookie"] == "tenant=alice; Path=/"  # passed on to its caller
    assert second.status_code == own.status_code == 200
    assert "cookie" not in sent[1].headers
    assert sent[2].headers["cookie"] == "mine=1"  # a caller's own cookie still passes


def test_headers_a_connection_header_names_are_not_forwarded_either_way() -> None:
    with FakeServer() as fake:
        hop = {"Connection": "x-hop-reply", "X-Hop-Reply": "1", "X-Kept": "2"}
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY, headers=hop))
        with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
            body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            sent = {"connection": "keep-alive, x-hop-ask", "x-hop-ask": "1", "x-kept-ask": "2"}
            reply = httpx.post(url + "/v1/chat/completions", json=body, headers=sent)
        got = fake.requests[0].headers
    assert "x-hop-ask" not in got and got["x-kept-ask"] == "2"
    assert "x-hop-reply" not in reply.headers and reply.headers["x-kept"] == "2"


def test_head_keeps_the_workers_content_length() -> None:
    models = {"object": "list", "data": [{"id": "m", "object": "model"}]}
    size = len(json.dumps(models))
    with FakeServer() as fake:
        fake.route("HEAD", "/v1/models", Reply(json=models))
        with serve_in_thread(GatewayConfig(workers=(fake.url,))) as (url, _):
            reply = httpx.head(url + "/v1/models")
    assert reply.status_code == 200
    assert reply.headers["content-length"] == str(size)  # as the worker said, not 0
    assert reply.content == b""

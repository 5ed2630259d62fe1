"""Routing by content: a pool without a router places each head on a worker and keeps its
sessions there; capacity is respected (a head beyond it is served and reported not placed);
behind sglang-router (scripted here) every call carries its head's sha as the routing key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer
from tests.fakeserver import FakeServer, Reply
from tests.gateway_peer import serve_gateway


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, "max_tokens": 4}


@pytest.fixture
def two_sims() -> Iterator[tuple[SimServer, SimServer]]:
    with SimServer(SimConfig(speed=5000)) as a, SimServer(SimConfig(speed=5000)) as b:
        yield a, b


def test_each_head_gets_a_worker_and_its_sessions_stay_there(
    two_sims: tuple[SimServer, SimServer],
) -> None:
    urls = tuple(s.url for s in two_sims)
    heads = [f"loop {name} system prompt. " * 60 for name in ("alpha", "beta")]
    with serve_in_thread(GatewayConfig(workers=urls)) as (url, _), httpx.Client() as client:
        seen: dict[int, list[str]] = {0: [], 1: []}
        verdicts: dict[int, list[str]] = {0: [], 1: []}
        turns: dict[int, list[str]] = {0: ["task"], 1: ["task"]}
        for _ in range(3):
            for i, system in enumerate(heads):
                r = client.post(url + "/v1/chat/completions", json=chat(system, *turns[i]))
                seen[i].append(r.headers["x-prefixreg-worker"])
                verdicts[i].append(r.headers["x-prefixreg-verdict"])
                turns[i] += ["ok", "next"]
    assert len(set(seen[0])) == len(set(seen[1])) == 1  # a session stays on its worker
    assert seen[0][0] != seen[1][0]  # two heads, two workers
    assert verdicts[0][1:] == verdicts[1][1:] == ["resumed", "resumed"]


def test_a_head_beyond_capacity_is_served_and_reported_not_placed(
    two_sims: tuple[SimServer, SimServer],
) -> None:
    urls = tuple(s.url for s in two_sims)
    config = GatewayConfig(workers=urls, capacities=(1, 1))
    with serve_in_thread(config) as (url, gw), httpx.Client() as client:
        for name in ("alpha", "beta"):  # two returning heads fill the pool
            system = f"loop {name} system prompt. " * 60
            client.post(url + "/v1/chat/completions", json=chat(system, "task"))
            client.post(url + "/v1/chat/completions", json=chat(system, "task", "ok", "more"))
        extra = client.post(url + "/v1/chat/completions", json=chat("gamma head. " * 60, "x"))
    assert extra.status_code == 200  # served
    assert extra.headers["x-prefixreg-placement"].startswith("not placed")
    assert gw.door.metrics.value("not_placed_total") == 1


def test_behind_a_router_every_call_carries_its_heads_sha_as_the_routing_key() -> None:
    reply = {"choices": [{"index": 0, "message": {"content": "k"}, "finish_reason": "stop"}]}
    with FakeServer() as router:
        router.route("POST", "/v1/chat/completions", Reply(json=reply))
        router.route("POST", "/v1/messages", Reply(json={"type": "message", "content": []}))
        config = GatewayConfig(workers=("http://127.0.0.1:9",), router=router.url)
        with serve_in_thread(config) as (url, _):
            a = httpx.post(url + "/v1/chat/completions", json=chat("head one " * 30, "x"))
            b = httpx.post(
                url + "/v1/messages",
                json={
                    "model": "m",
                    "max_tokens": 4,
                    "system": "head two " * 30,
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
        keys = [r.headers.get("x-smg-routing-key") for r in router.requests]
    assert keys == [a.headers["x-prefixreg-head"], b.headers["x-prefixreg-head"]]
    assert a.headers["x-prefixreg-worker"] == b.headers["x-prefixreg-worker"] == router.url


def test_prompt_cache_key_names_the_session_across_heads(
    two_sims: tuple[SimServer, SimServer],
) -> None:
    urls = tuple(s.url for s in two_sims)
    with serve_in_thread(GatewayConfig(workers=urls)) as (url, _), httpx.Client() as client:
        one = client.post(
            url + "/v1/chat/completions", json={**chat("a " * 50, "x"), "prompt_cache_key": "k1"}
        )
        two = client.post(
            url + "/v1/chat/completions", json={**chat("b " * 50, "y"), "prompt_cache_key": "k1"}
        )
    assert one.headers["x-prefixreg-session"] == two.headers["x-prefixreg-session"]
    assert two.headers["x-prefixreg-drift"].startswith("system")
    assert "k1" not in one.headers["x-prefixreg-session"]


def test_a_pool_placement_routes_its_heads_and_gives_the_router_its_key(tmp_path: Path) -> None:
    from prefixreg.verbs.pool.spec import Assignment, parse_pool_file, save_placement

    reply = {"choices": [{"index": 0, "message": {"content": "k"}, "finish_reason": "stop"}]}
    head_a = chat("placed head " * 30, "x")
    with FakeServer() as router, FakeServer() as w1, FakeServer() as w2:
        for server in (router, w1, w2):
            server.route("POST", "/v1/chat/completions", Reply(json=reply))
        with serve_in_thread(GatewayConfig(workers=(w1.url,))) as (url, _):
            sha = httpx.post(url + "/v1/chat/completions", json=head_a).headers["x-prefixreg-head"]
        pool = tmp_path / "pool.toml"
        workers = "".join(f'[[workers]]\nurl = "{w.url}"\n' for w in (w1, w2))
        pool.write_text(f'router = "{router.url}"\n' + workers)
        spec = parse_pool_file(pool)
        assert spec.placement_path is not None
        save_placement(spec.placement_path, spec, [Assignment(sha, w2.url, f"{sha}.1")])
        with serve_gateway("--pool", str(pool)) as url:  # behind the router: its re-keyed key
            httpx.post(url + "/v1/chat/completions", json=head_a)
        assert router.requests[-1].headers["x-smg-routing-key"] == f"{sha}.1"
        placement = ((sha, w2.url, f"{sha}.1"),)
        config = GatewayConfig(workers=(w1.url, w2.url), placement=placement)
        with serve_in_thread(config) as (url, _):  # no router: the placed worker
            for _ in range(3):
                r = httpx.post(url + "/v1/chat/completions", json=head_a)
                assert r.headers["x-prefixreg-worker"] == w2.url
        assert len(w2.requests) == 3


def test_two_replicas_give_one_head_one_routing_key() -> None:
    reply = {"choices": [{"index": 0, "message": {"content": "k"}, "finish_reason": "stop"}]}
    with FakeServer() as router:
        router.route("POST", "/v1/chat/completions", Reply(json=reply))
        config = GatewayConfig(workers=("http://127.0.0.1:9",), router=router.url)
        with serve_in_thread(config) as (one, _), serve_in_thread(config) as (two, _):
            httpx.post(one + "/v1/chat/completions", json=chat("fleet head " * 30, "a"))
            httpx.post(two + "/v1/chat/completions", json=chat("fleet head " * 30, "b"))
        keys = {r.headers["x-smg-routing-key"] for r in router.requests}
    assert len(keys) == 1 and len(router.requests) == 2

"""The gateway's pass-through and proof against the simulator and scripted loopback servers:
the bytes a worker sent are the bytes the client got (streamed and not), through the real
openai SDK and through a raw client; proof headers, the call log and /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli
from tests.gateway_peer import Tap, serve_gateway

SYSTEM = "You are a careful coding assistant. Follow the house rules. " * 40


def chat_body(user: str = "hello", **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, "max_tokens": 4, **extra}


@pytest.fixture(scope="module")
def sim_tap() -> Iterator[tuple[SimServer, Tap]]:
    with SimServer(SimConfig(speed=5000)) as sim, Tap(sim.url) as tap:
        yield sim, tap


@pytest.fixture(scope="module")
def gateway(
    sim_tap: tuple[SimServer, Tap], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    log = tmp_path_factory.mktemp("gw") / "calls.jsonl"
    with serve_gateway("--worker", sim_tap[1].url, "--call-log", str(log)) as url:
        yield url, log


def _tapped(tap: Tap, body: bytes) -> list[bytes]:
    return [r.body for r in tap.replies() if r.body == body]


def test_non_streamed_bytes_are_the_workers_and_proof_is_in_headers(
    gateway: tuple[str, Path], sim_tap: tuple[SimServer, Tap]
) -> None:
    url, _ = gateway
    first = httpx.post(url + "/v1/chat/completions", json=chat_body("one"))
    second = httpx.post(url + "/v1/chat/completions", json=chat_body("two"))
    assert first.status_code == second.status_code == 200
    for reply in (first, second):
        assert _tapped(sim_tap[1], reply.content) == [reply.content]  # byte for byte
        assert reply.headers["x-prefixreg-head"] == second.headers["x-prefixreg-head"]
    assert first.headers["x-prefixreg-verdict"] == "cold"
    assert second.headers["x-prefixreg-verdict"] == "resumed"
    usage = second.json()["usage"]
    assert (
        int(second.headers["x-prefixreg-cached"]) == usage["prompt_tokens_details"]["cached_tokens"]
    )
    assert "came from the cache" in second.headers["x-prefixreg-reason"]


def test_streamed_bytes_are_the_workers_and_the_verdict_is_logged(
    gateway: tuple[str, Path], sim_tap: tuple[SimServer, Tap]
) -> None:
    url, log = gateway
    body = chat_body("three", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        call = reply.headers["x-prefixreg-call"]
        assert "x-prefixreg-verdict" not in reply.headers  # not known before the stream ends
        got = b"".join(reply.iter_raw())
    assert _tapped(sim_tap[1], got) == [got]
    record = httpx.get(f"{url}/prefixreg/calls/{call}").json()
    assert record["gateway"]["streamed"] is True
    assert record["gateway"]["verdict"] in ("resumed", "partial")
    assert record["evidence"]["complete"] is True
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert call in [x["gateway"]["call"] for x in lines]
    assert SYSTEM[:40] not in log.read_text()  # hashes and counts, no prompt text


def test_the_openai_sdk_runs_through_unchanged(
    gateway: tuple[str, Path], sim_tap: tuple[SimServer, Tap]
) -> None:
    url, _ = gateway
    with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        _sdk_calls(client)


def _sdk_calls(client: OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(**chat_body("sdk"))  # type: ignore[call-overload]
    done = raw.parse()
    assert done.usage is not None and done.usage.prompt_tokens > 0
    assert raw.headers["x-prefixreg-verdict"] in ("resumed", "partial", "cold")
    stream = client.chat.completions.create(
        **chat_body("sdk stream"), stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    models = client.models.list()
    assert models.data


def test_models_and_health_pass_through(
    gateway: tuple[str, Path], sim_tap: tuple[SimServer, Tap]
) -> None:
    url, _ = gateway
    direct = httpx.get(sim_tap[0].url + "/v1/models")
    through = httpx.get(url + "/v1/models")
    assert through.status_code == direct.status_code == 200
    assert through.content == direct.content
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_metrics_count_the_servers_tokens(gateway: tuple[str, Path]) -> None:
    url, log = gateway
    httpx.post(url + "/v1/chat/completions", json=chat_body("metrics"))
    text = httpx.get(url + "/metrics").text
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    ev = [x["evidence"] for x in lines if x["evidence"]["cache_state"] != "unverified"]

    def total(name: str) -> float:
        rows = [r for r in text.splitlines() if r.startswith(f"prefixreg_gateway_{name}{{")]
        return sum(float(r.rsplit(" ", 1)[1]) for r in rows)

    assert total("prompt_tokens_total") == sum(e["prompt_tokens"] for e in ev)
    assert total("resumed_tokens_total") == sum(e["cached_tokens"] for e in ev)
    assert total("uncached_tokens_total") == sum(
        e["prompt_tokens"] - e["cached_tokens"] for e in ev
    )
    assert 'prefixreg_gateway_calls_total{api="chat"' in text
    assert "prefixreg_gateway_added_seconds_count" in text


def test_a_stream_without_usage_is_unverified_and_says_so(tmp_path: Path) -> None:
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw),
    ):
        with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(stream=True)) as r:
            call = r.headers["x-prefixreg-call"]
            r.read()
        record: Any = gw.door.call_record(call)
    assert record is not None
    assert record["gateway"]["verdict"] == "unverified"
    assert record["gateway"]["miss"].startswith("engine reported nothing: usage missing")
    assert "include_usage" in record["gateway"]["miss"]


def test_audit_reads_the_call_log_as_it_is_and_its_totals_are_the_servers(
    tmp_path: Path,
) -> None:
    log = tmp_path / "calls.jsonl"
    usages: list[dict[str, Any]] = []
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_gateway("--worker", sim.url, "--call-log", str(log)) as url,
        httpx.Client(base_url=url) as client,
    ):
        turns = ["first task"]
        for i in range(4):
            messages = [{"role": "system", "content": SYSTEM}]
            messages += [
                {"role": ("user", "assistant")[j % 2], "content": t} for j, t in enumerate(turns)
            ]
            body = {"model": "m", "messages": messages, "max_tokens": 4}
            if i == 3:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    events = [x for x in r.iter_lines() if x.startswith("data: {")]
                usages.append(json.loads(events[-1][6:])["usage"])
            else:
                usages.append(client.post("/v1/chat/completions", json=body).json()["usage"])
            turns += ["ok", f"task {i + 2}"]
    done = run_cli("audit", str(log), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["calls"] == 4 and report["malformed"] == []
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    assert report["tokens"]["prompt"]["total"] == prompt  # the server's own counts
    assert report["tokens"]["cached"]["total"] == cached
    assert report["states"] == {"cold": 1, "partial": 0, "reused": 3, "unverified": 0}
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["gateway"]["verdict"] for x in lines] == ["cold", "resumed", "resumed", "resumed"]

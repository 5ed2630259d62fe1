"""The gateway in front of the real llama-server (`tests.peer.fixtures`): the openai SDK (chat
completions, streamed and not; Responses) and the anthropic SDK (Messages) run through it
with only a base-URL change, the bytes the worker sent are the bytes the client got (a tap
records the worker's side of the same call), the verdict is the judge's from the server's
own counts, audit of the call log equals the server's counters, and slots of its own keep a
loop's history through a tenant's bursts on two slots."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.conftest import run_cli
from tests.gateway_peer import Tap, serve_gateway
from tests.peer.llama_peer import PeerServer

pytestmark = pytest.mark.timeout(900)  # the first test may pay the peer's install

_WORDS = ("ledger", "harbor", "quartz", "violet", "meadow", "copper", "signal", "lantern")


def prose(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Rules {seed}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) + "\n"


SYSTEM = prose(1, 220)


@pytest.fixture(scope="module")
def tapped(
    llama_server: PeerServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Tap, Path]]:
    log = tmp_path_factory.mktemp("gw-llama") / "calls.jsonl"
    with (
        Tap(llama_server.url) as tap,
        serve_gateway("--worker", tap.url, "--call-log", str(log)) as url,
    ):
        yield url, tap, log


def _sent_by_worker(tap: Tap, body: bytes) -> bool:
    return any(r.body == body for r in tap.replies())


def test_openai_chat_completions_pass_byte_for_byte_and_are_proven(
    tapped: tuple[str, Tap, Path],
) -> None:
    url, tap, _ = tapped
    with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        kwargs: Any = {"model": "peer", "max_tokens": 2, "temperature": 0}
        msgs: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]
        first = client.chat.completions.with_raw_response.create(messages=msgs, **kwargs)
        msgs[1]["content"] = "two"
        second = client.chat.completions.with_raw_response.create(messages=msgs, **kwargs)
        msgs[1]["content"] = "three"
        stream = client.chat.completions.create(
            messages=msgs, stream=True, stream_options={"include_usage": True}, **kwargs
        )
        chunks = list(stream)
    for raw in (first, second):
        assert _sent_by_worker(tap, raw.http_response.content)
    done = second.parse()
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert second.headers["x-prefixreg-verdict"] == "resumed"
    assert (
        int(second.headers["x-prefixreg-cached"]) == done.usage.prompt_tokens_details.cached_tokens
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        json={
            "messages": msgs,
            "stream": True,
            "stream_options": {"include_usage": True},
            "model": "peer",
            "max_tokens": 2,
        },
    ) as r:
        call = r.headers["x-prefixreg-call"]
        got = b"".join(r.iter_raw())
    assert _sent_by_worker(tap, got)  # streamed, byte for byte
    record = httpx.get(f"{url}/prefixreg/calls/{call}").json()
    assert record["gateway"]["verdict"] == "resumed"
    assert record["evidence"]["cached_source"] == "usage.prompt_tokens_details.cached_tokens"


def test_openai_responses_pass_byte_for_byte_and_are_proven(
    tapped: tuple[str, Tap, Path],
) -> None:
    url, tap, _ = tapped
    with OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        kwargs: Any = {"model": "peer", "instructions": SYSTEM, "max_output_tokens": 2}
        client.responses.create(input="warm", **kwargs)
        raw = client.responses.with_raw_response.create(input="again", **kwargs)
        events = list(client.responses.create(input="streamed", stream=True, **kwargs))
    assert _sent_by_worker(tap, raw.http_response.content)
    parsed = raw.parse()
    assert parsed.usage is not None and parsed.usage.input_tokens > 0
    assert raw.headers["x-prefixreg-verdict"] == "resumed"
    cached = parsed.usage.input_tokens_details.cached_tokens
    assert int(raw.headers["x-prefixreg-cached"]) == cached
    assert events[-1].type == "response.completed"


def test_anthropic_messages_pass_byte_for_byte_and_are_proven(
    tapped: tuple[str, Tap, Path],
) -> None:
    url, tap, log = tapped
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        kwargs: Any = {"model": "peer", "system": SYSTEM, "max_tokens": 2}
        client.messages.create(messages=[{"role": "user", "content": "warm"}], **kwargs)
        raw = client.messages.with_raw_response.create(
            messages=[{"role": "user", "content": "again"}], **kwargs
        )
        with client.messages.stream(
            messages=[{"role": "user", "content": "streamed"}], **kwargs
        ) as stream:
            final = stream.get_final_message()
    assert _sent_by_worker(tap, raw.http_response.content)
    message = raw.parse()
    read = message.usage.cache_read_input_tokens
    assert raw.headers["x-prefixreg-verdict"] == "resumed"
    assert int(raw.headers["x-prefixreg-cached"]) == read
    assert final.usage.output_tokens > 0
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    streamed = [x for x in lines if x["gateway"]["api"] == "messages" and x["gateway"]["streamed"]]
    assert streamed and streamed[-1]["gateway"]["verdict"] == "resumed"
    usage = final.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert streamed[-1]["evidence"]["prompt_tokens"] == total


def _counters(server: PeerServer) -> tuple[float, float]:
    m = server.metrics()
    return m["llamacpp:prompt_tokens_total"], m["llamacpp:prompt_tokens_cached_total"]


def test_audit_of_the_call_log_equals_the_servers_own_totals(
    llama_server: PeerServer, tmp_path: Path
) -> None:
    log = tmp_path / "calls.jsonl"
    system = prose(7, 200)
    before = _counters(llama_server)
    with (
        serve_gateway("--worker", llama_server.url, "--call-log", str(log)) as url,
        httpx.Client(base_url=url, timeout=600) as client,
    ):
        history: list[dict[str, str]] = [{"role": "user", "content": "task"}]
        for i in range(3):
            body: dict[str, Any] = {
                "model": "peer",
                "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, *history],
            }
            if i == 2:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.read()
            else:
                client.post("/v1/chat/completions", json=body)
            history += [
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"t{i}"},
            ]
        client.post(
            "/v1/messages",
            json={
                "model": "peer",
                "max_tokens": 2,
                "system": system,
                "messages": [{"role": "user", "content": "m"}],
            },
        )
    after = _counters(llama_server)
    uncached, cached = after[0] - before[0], after[1] - before[1]
    done = run_cli("audit", str(log), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["calls"] == 4
    assert report["tokens"]["cached"]["total"] == cached
    assert report["tokens"]["prompt"]["total"] == uncached + cached
    verdicts = [json.loads(x)["gateway"]["verdict"] for x in log.read_text().splitlines()]
    # The first call finds at most the template's first tokens of the slot's last prompt.
    assert verdicts[0] in ("cold", "partial") and verdicts[1:] == ["resumed"] * 3


def _loop_with_tenant(server: PeerServer, *gateway_args: str) -> list[str]:
    """Three turns of a loop through the gateway; after each, a tenant's two prompts at once,
    also through the gateway. The loop's verdicts."""
    verdicts: list[str] = []
    system = prose(11, 200)
    with (
        serve_gateway("--worker", server.url, *gateway_args) as url,
        httpx.Client(base_url=url, timeout=600) as client,
    ):
        history: list[dict[str, str]] = [{"role": "user", "content": "solve it"}]
        for turn in range(3):
            body = {
                "model": "peer",
                "max_tokens": 2,
                "messages": [{"role": "system", "content": system}, *history],
            }
            reply = client.post("/v1/chat/completions", json=body)
            verdicts.append(reply.headers["x-prefixreg-verdict"])
            history += [
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"step {turn}"},
            ]

            def tenant(seed: int) -> None:
                foreign = {
                    "model": "peer",
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": prose(seed, 200)},
                        {"role": "user", "content": "hello"},
                    ],
                }
                httpx.post(url + "/v1/chat/completions", json=foreign, timeout=600)

            burst = [threading.Thread(target=tenant, args=(1000 + 2 * turn + k,)) for k in (0, 1)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
    return verdicts


def test_slots_of_its_own_keep_the_loop_through_a_tenants_bursts(
    llama_server_small_cache: PeerServer,
) -> None:
    llama_server_small_cache.erase_slots()
    shared = _loop_with_tenant(llama_server_small_cache)
    llama_server_small_cache.erase_slots()
    owned = _loop_with_tenant(llama_server_small_cache, "--own-slots")
    assert shared[1:] != ["resumed", "resumed"]  # two foreign prompts at once evict it
    assert owned[2] == "resumed"  # from its second call the loop owns a slot

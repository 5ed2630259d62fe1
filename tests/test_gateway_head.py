"""The head at the door: named from the registry, registered with --register, drift named
(and refused with --on-drift refuse), volatile text stripped, what sessions share proposed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.core.prefix import text_bytes
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.registry.store import Registry
from prefixreg.sim import SimConfig, SimServer
from tests.fakeserver import FakeServer, Reply

SYSTEM = "You are a coding agent. Obey the repository's rules and keep diffs small. " * 30
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


def chat(system: str, *turns: str, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, "max_tokens": 4, **extra}


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=5000)) as server:
        yield server


def _wait(predicate: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return bool(predicate())


def test_a_registered_frame_names_the_head(sim: SimServer, registry: Registry) -> None:
    system = registry.add(SYSTEM, name="agent-system")
    spaced = (
        b'[ {"type": "function",  "function": {"name": "run", "parameters": {"type": "object"}}} ]'
    )
    registry.add_frame(system, tools=spaced, name="agent")
    registry.add("some other prefix", name="other")
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root)
    with serve_in_thread(config) as (url, _):
        framed = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "hi", tools=TOOLS))
        bare = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "hi"))
        unknown = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM + "!", "hi"))
    assert framed.headers["x-prefixreg-head-name"] == "agent"
    assert bare.headers["x-prefixreg-head-name"] == "agent-system"  # a bare prefix is a head
    assert "x-prefixreg-head-name" not in unknown.headers
    assert unknown.headers["x-prefixreg-head-known"] == "unregistered"
    assert bare.headers["x-prefixreg-head"] == system  # no tools, no settings: the prefix sha


def test_register_adds_an_unknown_head_as_a_frame_with_the_heads_sha(
    sim: SimServer, registry: Registry
) -> None:
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root, register=True)
    body = chat(SYSTEM, "hi", tools=TOOLS, tool_choice="auto")
    with serve_in_thread(config) as (url, gw):
        first = httpx.post(url + "/v1/chat/completions", json=body)
        assert _wait(lambda: gw.door.known.registered == 1)
        again = httpx.post(
            url + "/v1/chat/completions", json=chat(SYSTEM, "more", tools=TOOLS, tool_choice="auto")
        )
    sha = first.headers["x-prefixreg-head"]
    frame = registry.frame(sha)  # verified: the registered frame is the head the gateway hashed
    assert frame.system.text == SYSTEM
    assert frame.tools == TOOLS and frame.settings == {"tool_choice": "auto"}
    assert registry.meta(frame.system.sha256).source == "gateway/chat"
    assert first.headers["x-prefixreg-head-known"] == "unregistered"
    assert again.headers["x-prefixreg-head-known"] == "registered"
    assert gw.door.known.registered == 1


def test_drift_is_named_with_the_part_and_the_first_differing_byte(sim: SimServer) -> None:
    nonce_a, nonce_b = "Session nonce 1111. " + SYSTEM, "Session nonce 2222. " + SYSTEM
    loop = {"x-session-id": "loop-1"}
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw):
        first = httpx.post(url + "/v1/chat/completions", json=chat(nonce_a, "task"), headers=loop)
        second = httpx.post(
            url + "/v1/chat/completions", json=chat(nonce_b, "task", "ok", "go"), headers=loop
        )
        record: Any = gw.door.call_record(second.headers["x-prefixreg-call"])
    assert first.headers["x-prefixreg-session"] == second.headers["x-prefixreg-session"]
    assert second.headers["x-prefixreg-drift"] == "system at byte 14"
    assert second.headers["x-prefixreg-drift-bytes"] == "now '2222. You are a ' at byte 14"
    assert second.headers["x-prefixreg-verdict"] != "resumed"
    assert second.headers["x-prefixreg-reason"].startswith("head changed (drift: system at byte 14")
    assert record["gateway"]["drift"] == {"part": "system", "offset": 14}
    assert "2222" not in str(record)  # the excerpt goes to the client only
    assert "1111" not in str(second.headers)  # and never shows the earlier head
    assert gw.door.metrics.value("drift_total", part="system") == 1


def test_refuse_answers_in_the_apis_shape_and_forwards_nothing(sim: SimServer) -> None:
    config = GatewayConfig(workers=(sim.url,), on_drift="refuse")
    key = {"prompt_cache_key": "task-7"}
    me = {"authorization": "Bearer tenant-a"}  # one caller behind the key: its own drift
    with serve_in_thread(config) as (url, _):
        ok = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "a", **key), headers=me)
        before = len(sim.requests())
        refused = httpx.post(
            url + "/v1/chat/completions", json=chat(SYSTEM + " v2", "b", **key), headers=me
        )
        after = len(sim.requests())
    assert ok.status_code == 200
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "head changed" in error["message"] and "refused by --on-drift refuse" in error["message"]
    assert refused.headers["x-prefixreg-drift"].startswith("system at byte")
    assert after == before


def test_another_tenants_head_is_never_shown_nor_a_reason_to_refuse(sim: SimServer) -> None:
    config = GatewayConfig(workers=(sim.url,), on_drift="refuse")
    alice, bob = "Alice's secret rules: 4242. " + SYSTEM, "Bob's rules. " + SYSTEM
    shared = {"prompt_cache_key": "default"}
    with serve_in_thread(config) as (url, _):
        a = {"authorization": "Bearer alice"}
        b = {"authorization": "Bearer bob"}
        post = url + "/v1/chat/completions"
        first = httpx.post(post, json=chat(alice, "hi", **shared), headers=a)
        keyed = httpx.post(post, json=chat(bob, "hi", **shared), headers=b)
        # No key: the same turn under another head is another session, not drift.
        httpx.post(post, json=chat(alice, "task", "ok", "go"), headers=a)
        chained = httpx.post(post, json=chat(bob, "task", "ok", "go"), headers=b)
    assert first.status_code == keyed.status_code == chained.status_code == 200
    assert keyed.headers["x-prefixreg-drift"] == "system at byte 0"  # named, not refused
    assert "Alice" not in str(keyed.headers) and "4242" not in str(keyed.headers)
    assert keyed.headers["x-prefixreg-drift-bytes"].startswith("now 'Bob")
    assert "x-prefixreg-drift" not in chained.headers


def test_strip_removes_the_nonce_before_forwarding_and_the_cache_resumes(sim: SimServer) -> None:
    config = GatewayConfig(workers=(sim.url,), strip=(r"^Session nonce \d+\. ",))
    with serve_in_thread(config) as (url, gw):
        one = httpx.post(url + "/v1/chat/completions", json=chat("Session nonce 1. " + SYSTEM, "t"))
        two = httpx.post(
            url + "/v1/chat/completions", json=chat("Session nonce 2. " + SYSTEM, "t", "ok", "go")
        )
    assert one.headers["x-prefixreg-head"] == two.headers["x-prefixreg-head"]
    assert "x-prefixreg-drift" not in two.headers
    assert two.headers["x-prefixreg-verdict"] == "resumed"
    assert two.headers["x-prefixreg-stripped"] == "1"
    assert gw.door.metrics.value("strips_total") == 2


def test_strip_drops_an_anthropic_billing_block_from_system() -> None:
    with FakeServer() as fake:
        fake.route("POST", "/v1/messages", Reply(json={"type": "message", "content": []}))
        config = GatewayConfig(workers=(fake.url,), strip=(r"^x-anthropic-billing-header:.*$",))
        body = {
            "model": "m",
            "max_tokens": 4,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"},
                {"type": "text", "text": SYSTEM},
            ],
            "messages": [{"role": "user", "content": "hi"}],
        }
        with serve_in_thread(config) as (url, _):
            reply = httpx.post(url + "/v1/messages", json=body)
        sent = fake.requests[0].json
    assert reply.status_code == 200
    assert sent["system"] == [{"type": "text", "text": SYSTEM}]
    assert sent["messages"] == body["messages"]


def test_dynamic_text_before_static_text_in_the_first_user_message_is_named(
    sim: SimServer,
) -> None:
    rules = "Follow the workflow: read, plan, edit, test, submit. " * 20
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw):
        httpx.post(
            url + "/v1/chat/completions", json=chat(SYSTEM, "Please solve issue 17. " + rules)
        )
        second = httpx.post(
            url + "/v1/chat/completions", json=chat(SYSTEM, "Please solve issue 942. " + rules)
        )
    assert "dynamic text before static text" in second.headers["x-prefixreg-note"]
    assert gw.door.metrics.value("dynamic_first_total") == 1


def test_leading_messages_every_session_shares_are_proposed(sim: SimServer) -> None:
    shots = ["Example question one.", "Example answer one.", "Example question two.", "Ex two."]
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, _):
        for task in ("task alpha", "task beta", "task gamma"):
            httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, *shots, task))
        heads = httpx.get(url + "/prefixreg/heads").json()
    assert len(heads) == 1
    assert heads[0]["sessions"] == 3
    assert heads[0]["shared_leading_messages"] == 4
    leading = chat(SYSTEM, *shots)["messages"][1:]
    assert heads[0]["shared_leading_bytes"] == text_bytes(leading)  # as the judge counts bytes


def test_a_failing_door_still_forwards_the_call(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from prefixreg.gateway import head

    def broken(*_: object) -> None:
        raise RuntimeError("boom")  # a bug in prefixreg's own code, not in the call

    monkeypatch.setattr(head, "head_of", broken)
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw):
        reply = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "hi"))
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] > 0
        assert gw.door.metrics.value("failures_total", where="door") == 1


def test_a_session_keeps_64_kib_of_its_head_and_drift_past_it_is_still_named() -> None:
    from prefixreg.gateway.apis import CHAT
    from prefixreg.gateway.head import KEPT_BYTES, drift_of, head_of, kept

    long = "x" * (KEPT_BYTES + 5000)
    before, _ = head_of(CHAT, chat(long, "a"))
    after, _ = head_of(CHAT, chat(long[:-10] + "y" * 10, "a"))
    early, _ = head_of(CHAT, chat("z" + long[1:], "a"))
    assert before is not None and after is not None and early is not None
    held = kept(before)
    assert len(held.system) == KEPT_BYTES and held.sha256 == before.sha256
    late = drift_of(held, after)
    assert late is not None and late.part == "system" and late.offset is None
    first = drift_of(held, early)
    assert first is not None and first.offset == 0
    assert drift_of(held, before) is None


def test_a_returning_call_is_also_judged_against_its_sessions_last_prompt(sim: SimServer) -> None:
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw):
        one = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "long task " * 200))
        two = httpx.post(
            url + "/v1/chat/completions", json=chat(SYSTEM, "long task " * 200, "ok", "go")
        )
        record: Any = gw.door.call_record(two.headers["x-prefixreg-call"])
    assert "x-prefixreg-session-verdict" not in one.headers  # a first call extends nothing
    assert two.headers["x-prefixreg-verdict"] == "resumed"
    assert two.headers["x-prefixreg-session-verdict"] == "resumed"
    assert record["gateway"]["extends"] == 1
    span = record["gateway"]["session_judgement"]["span_tokens"]
    assert span > record["gateway"]["judgement"]["span_tokens"]  # the head and the history


def test_a_registry_that_fails_its_check_leaves_heads_unnamed_and_calls_going(
    sim: SimServer, registry: Registry
) -> None:
    system = registry.add(SYSTEM, name="agent-system")
    frame = registry.add_frame(system, tools=b'[{"type": "function"}]', name="agent")
    record = registry.root / "frames" / f"{frame}.json"
    record.write_bytes(record.read_bytes().replace(b"prefix-frame", b"prefix-frane"))
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root)
    tools = [{"type": "function"}]
    with serve_in_thread(config) as (url, gw):
        framed = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "hi", tools=tools))
        bare = httpx.post(url + "/v1/chat/completions", json=chat(SYSTEM, "hi"))
        metrics = httpx.get(url + "/metrics").text
    assert framed.status_code == bare.status_code == 200
    assert framed.headers["x-prefixreg-head-known"] == "unregistered"  # its record failed
    assert bare.headers["x-prefixreg-head-name"] == "agent-system"  # the rest still named
    assert gw.door.known.failures == 1
    assert "prefixreg_gateway_registry_failures 1" in metrics


def test_a_head_per_call_keeps_a_bounded_count_of_heads_and_their_workers(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("prefixreg.gateway.door.MAX_SEEN_HEADS", 5, raising=False)
    with serve_in_thread(GatewayConfig(workers=(sim.url,))) as (url, gw):
        last = ""
        for i in range(12):  # a per-request nonce: every call a new head
            reply = httpx.post(
                url + "/v1/chat/completions", json=chat(f"nonce {i}. " + SYSTEM, "t")
            )
            last = reply.headers["x-prefixreg-head"]
        seen = dict(gw.door.seen_on)
    assert len(seen) == 5
    assert last in seen  # the least recent went first


def test_registrations_waiting_on_a_slow_registry_are_bounded_and_counted(
    sim: SimServer, registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    monkeypatch.setattr("prefixreg.gateway.known.MAX_QUEUED", 3, raising=False)
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root, register=True)
    release = threading.Event()
    with serve_in_thread(config) as (url, gw):
        store = gw.door.known._registry
        assert store is not None
        real_add = store.add

        def slow_add(*args: Any, **kwargs: Any) -> str:  # a registry held by another writer
            release.wait(30)
            return real_add(*args, **kwargs)

        monkeypatch.setattr(store, "add", slow_add)
        for i in range(10):
            httpx.post(url + "/v1/chat/completions", json=chat(f"head {i}. " + SYSTEM, "t"))
        waiting = len(gw.door.known._pending)
        dropped = gw.door.known.dropped
        release.set()
        assert _wait(lambda: gw.door.known.registered == 3)
        text = httpx.get(url + "/metrics").text
    assert waiting == 3 and dropped == 7
    assert "registrations_dropped 7" in text

"""Slots of its own (`own_slots`): a returning session owns a llama.cpp slot, every other
call is pinned to the slots nobody owns. Against a scripted llama.cpp (`/slots`) here, the
real llama-server in tests/test_gateway_llama.py."""

from __future__ import annotations

from typing import Any

import httpx

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from tests.fakeserver import FakeServer, Reply

REPLY = {
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}],
    "usage": {
        "prompt_tokens": 50,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    },
}
SLOTS = [
    {"id": 0, "n_ctx": 4096, "is_processing": False},
    {"id": 1, "n_ctx": 4096, "is_processing": False},
]


def chat(system: str, *turns: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, "max_tokens": 4}


def test_a_returning_session_owns_its_slot_and_foreign_prompts_share_the_other() -> None:
    with FakeServer() as fake:
        fake.route("GET", "/slots", Reply(json=SLOTS))
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY))
        with serve_in_thread(GatewayConfig(workers=(fake.url,), own_slots=True)) as (url, gw):

            def post(body: dict[str, Any]) -> httpx.Response:
                return httpx.post(url + "/v1/chat/completions", json=body)

            first = post(chat("loop system " * 20, "task"))
            for i in range(3):
                post(chat(f"tenant {i} " * 20, "hello"))
            second = post(chat("loop system " * 20, "task", "ok", "next"))
            after = [post(chat(f"tenant b{i} " * 20, "hello")) for i in range(4)]
            third = post(chat("loop system " * 20, "task", "ok", "next", "ok", "more"))
            owned = gw.door.pins.plan.owned() if gw.door.pins.plan else 0
        sent = [r.json for r in fake.requests if r.path == "/v1/chat/completions"]
    mine = int(first.headers["x-prefixreg-slot"])
    assert second.headers["x-prefixreg-slot"] == third.headers["x-prefixreg-slot"] == str(mine)
    assert {r.headers["x-prefixreg-slot"] for r in after} == {str(1 - mine)}
    assert [b["id_slot"] for b in sent[-5:-1]] == [1 - mine] * 4
    assert sent[-1]["id_slot"] == mine
    assert all("id_slot" in b for b in sent)
    assert owned == 1


def test_a_call_that_names_its_slot_is_left_alone_and_one_slot_takes_no_part() -> None:
    with FakeServer() as fake:
        fake.route("GET", "/slots", Reply(json=SLOTS[:1]))
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY))
        with serve_in_thread(GatewayConfig(workers=(fake.url,), own_slots=True)) as (url, _):
            one = httpx.post(url + "/v1/chat/completions", json=chat("s " * 30, "a"))
        body = fake.requests[-1].body
    assert "x-prefixreg-slot" not in one.headers
    assert b"id_slot" not in body
    with FakeServer() as fake:
        fake.route("GET", "/slots", Reply(json=SLOTS))
        fake.route("POST", "/v1/chat/completions", Reply(json=REPLY))
        with serve_in_thread(GatewayConfig(workers=(fake.url,), own_slots=True)) as (url, _):
            pinned = {**chat("s " * 30, "a"), "id_slot": 0}
            httpx.post(url + "/v1/chat/completions", json=pinned)
        assert fake.requests[-1].json["id_slot"] == 0

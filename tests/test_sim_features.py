"""The simulator's lane features over loopback HTTP (#14): listen backlog, the documented 400s,
Flash `/metrics`, the slab wall (`cap_mb`, `refused`), the disk tier across a restart, and the
dense profile without the Flash counter lag or duplicate snapshots."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.core.prefix import fresh_tail
from prefixreg.sim import SimConfig, SimServer

FAST = 100_000.0


def client(sim: SimServer) -> httpx.Client:
    return httpx.Client(base_url=sim.url, trust_env=False, timeout=30)


def chat(system: str, tail: str | None = None, **kw: Any) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": tail if tail is not None else fresh_tail()},
    ]
    return {"messages": messages, "max_tokens": 1, **kw}


def cached(reply: dict[str, Any]) -> int:
    return int(reply["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def system_of(n_words: int, word: str = "s") -> str:
    return "head" + f" {word}" * n_words  # one-character words: one token each


def test_sixteen_connects_complete_without_an_accept() -> None:
    # Bound but not serving: the kernel completes handshakes into the listen backlog. With a
    # backlog of 5 the connects past it would wait for SYN retransmits (~1 s).
    sim = SimServer(SimConfig(speed=FAST))  # bound, not started
    socks: list[socket.socket] = []
    try:
        for _ in range(16):
            s = socket.create_connection((sim.host, sim.port), timeout=0.5)
            socks.append(s)
        assert len(socks) == 16
    finally:
        for s in socks:
            s.close()
        sim.stop()


BAD_REQUESTS = [
    ({"logprobs": True, "stream": True, "temperature": 0.7}, "body.logprobs"),
    ({"top_logprobs": 2, "temperature": 0.7}, "body.top_logprobs"),
    ({"drafter": "dflash9"}, "body.drafter"),
    ({"drafter": "ngram"}, "body.drafter"),  # a dense drafter, not Flash's
    ({"presence_penalty": 0.5}, "body.presence_penalty"),
    ({"presence_penalty": 0.5, "temperature": 0}, "body.presence_penalty"),
    ({"frequency_penalty": 0.5}, "body.frequency_penalty"),
    ({"logit_bias": {"1": 2}}, "body.logit_bias"),
    ({"logprobs": True}, "body.logprobs"),
    ({"chat_template_kwargs": {"enable_thinkin": False}}, "body.chat_template_kwargs"),
    (
        {"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": True},
        "body.chat_template_kwargs.enable_thinking",
    ),
    ({"tool_choice": ["auto"]}, "body.tool_choice"),  # a list, not a crash
]


@pytest.mark.parametrize(("extra", "loc"), BAD_REQUESTS)
def test_documented_400s(extra: dict[str, Any], loc: str) -> None:
    with SimServer(SimConfig(speed=FAST)) as sim, client(sim) as c:
        resp = c.post("/v1/chat/completions", json=chat("x", **extra))
        served = c.get("/cache").json()["stores"]
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None and error["code"] is None
    assert error["message"].startswith(loc)
    assert served == 0  # refused before it reached the engine


GOOD_REQUESTS = [
    {"presence_penalty": 0.5, "temperature": 0.7},
    {"logprobs": True, "temperature": 0.7},
    {"logprobs": False},
    {"drafter": "mtp"},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"chat_template_kwargs": {"enable_thinking": False}, "enable_thinking": False},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},  # OpenAI's object form
]


@pytest.mark.parametrize("extra", GOOD_REQUESTS)
def test_the_same_fields_used_as_documented_are_served(extra: dict[str, Any]) -> None:
    with SimServer(SimConfig(speed=FAST)) as sim, client(sim) as c:
        assert c.post("/v1/chat/completions", json=chat("x", **extra)).status_code == 200


def test_dense_has_its_own_drafters_and_ignores_template_kwargs() -> None:
    with SimServer(SimConfig.for_profile("dense", speed=FAST)) as sim, client(sim) as c:
        ok = c.post("/v1/chat/completions", json=chat("x", drafter="ngram"))
        kwargs = c.post("/v1/chat/completions", json=chat("x", chat_template_kwargs={"z": 1}))
        assert c.get("/metrics").status_code == 404  # dense exports no metrics
    assert ok.status_code == 200
    assert kwargs.status_code == 200


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_flash_metrics_count_cached_and_processed_prompt_tokens() -> None:
    config = SimConfig(speed=FAST, api_key="k3y")
    auth = {"Authorization": "Bearer k3y"}
    system = system_of(300)
    with SimServer(config) as sim, client(sim) as c:
        assert c.get("/health").json()["metrics"] == "/metrics"
        assert c.get("/metrics").status_code == 401
        tail = fresh_tail()
        cold = c.post("/v1/chat/completions", json=chat(system, tail), headers=auth).json()
        warm = c.post("/v1/chat/completions", json=chat(system, tail), headers=auth).json()
        resp = c.get("/metrics", headers=auth)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    n = cold["usage"]["prompt_tokens"]
    assert metric(resp.text, "halogen:prompt_tokens_cached_total") == cached(warm) == n - 7
    assert metric(resp.text, "llamacpp:prompt_tokens_total") == n + 7
    assert "# TYPE halogen:prompt_tokens_cached_total counter" in resp.text
    assert metric(resp.text, "halogen:kv_pool_positions") == 2 * 262_144


def test_cap_mb_is_the_slab_and_a_snapshot_it_cannot_take_is_refused() -> None:
    # 1 MiB slab at 2,048 bytes a token: snapshots of at most 512 tokens.
    with SimServer(SimConfig(speed=FAST, cap_mb=1)) as sim, client(sim) as c:
        assert c.get("/health").json()["prompt_cache"]["cap_mb"] == 1
        big, small = system_of(600), system_of(300, "t")
        tail = fresh_tail()
        for _ in range(2):
            reply = c.post("/v1/chat/completions", json=chat(big, tail)).json()
        after_big = c.get("/cache").json()
        for _ in range(2):
            fits = c.post("/v1/chat/completions", json=chat(small, tail)).json()
        after_small = c.get("/cache").json()
    assert cached(reply) == 0  # neither place of a 600-token prompt fits: never resumes
    assert (after_big["stores"], after_big["refused"], after_big["entries"]) == (0, 4, 0)
    assert cached(fits) == fits["usage"]["prompt_tokens"] - 7
    assert after_small["refused"] == 4
    assert after_small["last_entry_bytes"] == 1 << 20
    assert after_small["bytes"] == after_small["entries"] << 20


def test_the_disk_tier_restores_exactly_after_a_restart(tmp_path: Path) -> None:
    config = SimConfig(speed=1000, cache_dir=str(tmp_path))  # a restore of ~0.01 ms
    system, tail = system_of(400), fresh_tail()
    with SimServer(config) as sim, client(sim) as c:
        cold = c.post("/v1/chat/completions", json=chat(system, tail)).json()
        first = c.get("/cache").json()
    assert cold["timings"]["disk_restore_n"] == 0
    assert first["disk"]["persisted"] == 2 and first["disk"]["records"] == 2
    n = cold["usage"]["prompt_tokens"]
    with SimServer(config) as sim, client(sim) as c:  # a new process state, same directory
        warm = c.post("/v1/chat/completions", json=chat(system, tail)).json()
        fresh = c.post("/v1/chat/completions", json=chat(system_of(50, "q"))).json()
        after = c.get("/cache").json()
    assert cached(warm) == n - 7  # exact across the restart
    assert warm["timings"]["disk_restore_n"] == n - 7
    assert warm["timings"]["disk_restore_ms"] > 0
    assert "prompt_tokens_details" not in fresh["usage"]
    disk = after["disk"]
    assert (disk["on"], disk["hits"], disk["misses"], disk["persisted"]) == (True, 1, 1, 2)
    assert disk["skipped"] == 2  # the warm call's places were on disk already
    assert disk["records"] == 4
    assert disk["restored_bytes"] == (n - 7) * 27 * 1024
    assert disk["bytes"] <= disk["budget_bytes"] == 64 << 30
    assert after["hits"] + after["misses"] <= 2  # memory counters start again at 0
    # Another build (model id) has its own subtree: nothing to restore.
    with SimServer(dataclasses.replace(config, model="other")) as sim, client(sim) as c:
        other = c.post("/v1/chat/completions", json=chat(system, tail)).json()
    assert "prompt_tokens_details" not in other["usage"]


def test_a_disk_tier_write_that_fails_is_skipped_and_the_call_served(tmp_path: Path) -> None:
    with SimServer(SimConfig(speed=FAST, cache_dir=str(tmp_path))) as sim, client(sim) as c:
        for subtree in tmp_path.iterdir():
            shutil.rmtree(subtree)  # the build's subtree, removed underneath the running tier
        reply = c.post("/v1/chat/completions", json=chat(system_of(100)))
        disk = c.get("/cache").json()["disk"]
    assert reply.status_code == 200
    assert (disk["persisted"], disk["skipped"], disk["records"]) == (0, 2, 0)
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_disk_records_that_are_not_ours_are_ignored(tmp_path: Path) -> None:
    config = SimConfig(speed=FAST, cache_dir=str(tmp_path))
    system, tail = system_of(300), fresh_tail()
    with SimServer(config) as sim, client(sim) as c:
        c.post("/v1/chat/completions", json=chat(system, tail))
    (subtree,) = tmp_path.iterdir()
    real = sorted(subtree.iterdir())
    assert len(real) == 2
    real[0].write_bytes(b"[" * 100_000)  # corrupt (and deeper than any reader allows)
    (subtree / ("0" * 64 + ".json")).write_text('{"tokens": ["a"]}')  # named after other tokens
    os.mkfifo(subtree / ("1" * 64 + ".json"))  # not a regular file: never opened
    (subtree / ("2" * 64 + ".json")).symlink_to(real[1])
    with SimServer(config) as sim, client(sim) as c:
        assert c.get("/cache").json()["disk"]["records"] == 1  # only the intact record


def test_without_a_cache_dir_there_is_no_disk_block() -> None:
    with SimServer(SimConfig(speed=FAST)) as sim, client(sim) as c:
        reply = c.post("/v1/chat/completions", json=chat("x")).json()
        assert "disk" not in c.get("/cache").json()
    assert "disk_restore_n" not in reply["timings"]


def test_dense_has_no_counter_lag_no_duplicates_and_the_documented_budget() -> None:
    system, tail = system_of(5000), fresh_tail()
    with SimServer(SimConfig.for_profile("dense", speed=FAST)) as sim, client(sim) as c:
        health = c.get("/health").json()
        for _ in range(3):
            reply = c.post("/v1/chat/completions", json=chat(system, tail)).json()
        counters = c.get("/cache").json()
    assert health["prompt_cache"]["cap_mb"] == 61440
    assert counters["cap_bytes"] == 61440 << 20  # 64.4 GB: 3 entries of ~18.4 GB
    assert cached(reply) % 2048 == 0 and cached(reply) > 0
    assert (counters["hits"], counters["misses"]) == (2, 1)  # no lag: visible at once
    assert counters["prompt_tokens_saved"] == 2 * cached(reply)
    assert (counters["stores"], counters["entries"]) == (1, 1)  # the same snapshot, once


def test_a_dense_budget_below_one_entry_is_enabled_and_never_hits() -> None:
    # 8,192 MiB cannot hold one ~18.4 GB full-context entry: every store is refused.
    config = SimConfig.for_profile("dense", speed=FAST, cap_mb=8192)
    system, tail = system_of(5000), fresh_tail()
    with SimServer(config) as sim, client(sim) as c:
        assert c.get("/health").json()["prompt_cache"]["enabled"] is True
        for _ in range(2):
            reply = c.post("/v1/chat/completions", json=chat(system, tail)).json()
        counters = c.get("/cache").json()
    assert "prompt_tokens_details" not in reply["usage"]
    assert (counters["stores"], counters["refused"], counters["hits"]) == (0, 2, 0)
    assert counters["cap_bytes"] == 8192 << 20

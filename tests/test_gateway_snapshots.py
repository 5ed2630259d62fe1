"""Kept whole across foreign prompts, on the real llama-server (two slots, no RAM cache): with
`--keep-warm`, a loop whose history a tenant talking to the worker directly evicts between
its calls finds it again, because the gateway saved its slot after each call and restored it
when the tenant's prompt had taken it; the same loop sent direct does not. A worker without
slot actions leaves snapshot mode at once and its calls go on."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.gateway_peer import serve_gateway
from tests.peer.fixtures import peer_paths
from tests.peer.llama_peer import SMALL_CACHE_FLAGS, PeerServer, start
from tests.test_gateway_llama import prose

pytestmark = pytest.mark.timeout(900)


def _restores(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.findall(r'snapshots_total\{action="restore",outcome="ok"[^}]*\} (\S+)', text)
    return sum(float(x) for x in found)


def _loop(
    url: str, tenant: Callable[[int], None], wait: Callable[[int], None]
) -> list[dict[str, int]]:
    """Three turns; after each, the tenant's two prompts, then `wait(turn)`. Each call's usage."""
    system = prose(21, 260)
    history: list[dict[str, str]] = [{"role": "user", "content": "solve it"}]
    usages: list[dict[str, int]] = []
    with httpx.Client(base_url=url, timeout=600) as client:
        for turn in range(3):
            body = {
                "model": "peer",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "system", "content": system}, *history],
            }
            reply = client.post("/v1/chat/completions", json=body)
            reply.raise_for_status()
            usage = reply.json()["usage"]
            usages.append(
                {
                    "prompt": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"],
                }
            )
            history += [
                {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"step {turn}: go on"},
            ]
            tenant(turn)
            wait(turn)
    return usages


def _tenant(server: PeerServer) -> Callable[[int], None]:
    def two(turn: int) -> None:  # one after the other: the second takes the loop's slot
        for k in (0, 1):
            foreign = {
                "model": "peer",
                "max_tokens": 1,
                "messages": [
                    {"role": "user", "content": f"{turn}{k} " + prose(300 + 2 * turn + k, 90)}
                ],
            }
            httpx.post(server.url + "/v1/chat/completions", json=foreign, timeout=600)

    return two


def test_keep_warm_restores_the_slot_a_direct_tenant_took(
    llama_server_small_cache: PeerServer,
) -> None:
    server = llama_server_small_cache
    server.erase_slots()
    direct = _loop(server.url, _tenant(server), lambda turn: None)
    server.erase_slots()
    with serve_gateway("--worker", server.url, "--keep-warm") as url:

        def restored(turn: int) -> None:  # the gateway restores in the loop's tool time
            deadline = time.monotonic() + 60
            while _restores(url) < turn + 1 and time.monotonic() < deadline:
                time.sleep(0.1)

        kept = _loop(url, _tenant(server), restored)
        assert _restores(url) >= 2
    # Direct, the tenant's second prompt took the loop's slot: little beyond the template.
    assert all(u["cached"] < u["prompt"] // 2 for u in direct[1:]), direct
    # Through the gateway each call finds the whole previous prompt (the server's own count).
    for before, after in itertools.pairwise(kept):
        assert after["cached"] >= before["prompt"], kept


@contextmanager
def _no_slot_actions(tmp_path: Path) -> Iterator[PeerServer]:
    server = start(SMALL_CACHE_FLAGS, paths=peer_paths(), log_dir=tmp_path, slot_actions=False)
    try:
        yield server
    finally:
        server.stop()


def test_a_worker_without_slot_actions_leaves_snapshot_mode_and_calls_go_on(tmp_path: Path) -> None:
    with (
        _no_slot_actions(tmp_path) as server,
        serve_gateway("--worker", server.url, "--keep-warm") as url,
    ):
        body = {
            "model": "peer",
            "max_tokens": 2,
            "messages": [
                {"role": "system", "content": prose(5, 120)},
                {"role": "user", "content": "a"},
            ],
        }
        first = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        deadline = time.monotonic() + 30
        text = ""
        while time.monotonic() < deadline:
            text = httpx.get(url + "/metrics", timeout=30).text
            if 'failures_total{where="snapshots"}' in text:
                break
            time.sleep(0.1)
        second = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert first.status_code == second.status_code == 200
    assert 'failures_total{where="snapshots"} 1' in text
    assert 'action="save",outcome="ok"' not in text
    assert second.headers["x-prefixreg-verdict"] == "resumed"

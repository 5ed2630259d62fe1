"""Kept warm between turns: a gateway started with keep_warm keeps a live session's latest
request resumable on the simulator while foreign prompts (sent to the worker directly) churn
its LRU; the re-warms are counted apart, never as the loop's calls."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer

SYSTEM = "You are the loop's agent. Keep to the plan, report every step you take. " * 40


def chat(*turns: str, system: str = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, "max_tokens": 4}


def _run(keep: bool, log: Path) -> tuple[str, float]:
    with SimServer(SimConfig(speed=5000)) as sim:
        config = GatewayConfig(workers=(sim.url,), keep_warm=keep, call_log=log)
        with serve_in_thread(config) as (url, gw), httpx.Client(base_url=url) as client:
            client.post("/v1/chat/completions", json=chat("task one"))
            time.sleep(1.0)  # the keeper takes the session in and reads its baseline
            with httpx.Client(base_url=sim.url) as direct:
                for i in range(8):  # a tenant's prompts, each one a new head
                    direct.post(
                        "/v1/chat/completions", json=chat("hi", system=f"tenant {i} " * 300)
                    )
                    time.sleep(0.7)  # the keeper polls every 0.5 s
            second = client.post("/v1/chat/completions", json=chat("task one", "ok", "task two"))
            rewarms = gw.door.metrics.value("rewarms_total")
    return second.headers["x-prefixreg-verdict"], rewarms


def test_a_kept_session_resumes_after_foreign_prompts_and_an_unkept_one_does_not(
    tmp_path: Path,
) -> None:
    kept, rewarms = _run(True, tmp_path / "kept.jsonl")
    unkept, none = _run(False, tmp_path / "unkept.jsonl")
    assert unkept != "resumed" and none == 0  # the churn evicts a session nobody keeps
    assert kept == "resumed" and rewarms >= 1
    lines = (tmp_path / "kept.jsonl").read_text().splitlines()
    assert len(lines) == 2  # the keeper's re-warms are not the loop's calls
    assert all(json.loads(x)["gateway"]["api"] == "chat" for x in lines)

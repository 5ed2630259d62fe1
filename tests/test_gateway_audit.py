"""audit of the gateway's call log: its lever verdict is the one the gateway's per-call
judgements imply (each call's uncached tokens split by why the judge says it missed: drift,
a head not resumed, a session not resumed, else new history), on the simulator, for a loop
that keeps its cache and for one a tenant's prompts churn out between calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixreg.core.judge import judge_lever
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli

SYSTEM = "You are the loop. Read the issue, plan, edit the code, run the tests, report. " * 30


def _run(log: Path, *, churn: bool) -> None:
    with (
        SimServer(SimConfig(speed=5000)) as sim,
        serve_in_thread(GatewayConfig(workers=(sim.url,), call_log=log)) as (url, _),
        httpx.Client() as client,
    ):
        history: list[dict[str, str]] = [{"role": "user", "content": "the issue"}]
        for turn in range(6):
            body = {
                "model": "m",
                "max_tokens": 4,
                "messages": [{"role": "system", "content": SYSTEM}, *history],
            }
            client.post(url + "/v1/chat/completions", json=body)
            history += [
                {"role": "assistant", "content": "done"},
                {"role": "user", "content": f"output of step {turn}: " + "ok " * 300},
            ]
            for i in range(8 if churn else 0):  # a tenant's prompts, straight to the worker
                foreign = {
                    "model": "m",
                    "max_tokens": 4,
                    "messages": [
                        {"role": "system", "content": f"tenant {turn}-{i} " * 200},
                        {"role": "user", "content": "hi"},
                    ],
                }
                client.post(sim.url + "/v1/chat/completions", json=foreign)


def _implied(log: Path) -> str:
    split = {"cached": 0, "new_history": 0, "drift": 0, "miss": 0, "session": 0}
    for line in log.read_text().splitlines():
        record: Any = json.loads(line)
        ev, gw = record["evidence"], record["gateway"]
        cached, uncached = ev["cached_tokens"], ev["prompt_tokens"] - ev["cached_tokens"]
        split["cached"] += cached
        session = gw["session_judgement"]
        if gw["drift"] is not None:
            split["drift"] += uncached
        elif gw["verdict"] != "resumed":
            split["miss"] += uncached
        elif session is not None and session["verdict"] != "resumed":
            split["session"] += uncached
        else:
            split["new_history"] += uncached
    return judge_lever(**split)[0]


@pytest.mark.parametrize(("churn", "expected"), [(False, "not_lever"), (True, "lever")])
def test_audits_lever_verdict_is_the_one_the_gateways_judgements_imply(
    tmp_path: Path, churn: bool, expected: str
) -> None:
    log = tmp_path / "calls.jsonl"
    _run(log, churn=churn)
    done = run_cli("audit", str(log), "--json")
    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)["saving"]["lever"]["verdict"]
    assert verdict == _implied(log) == expected

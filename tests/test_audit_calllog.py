"""A loop hands its calls to `audit`: `Session(call_log=)` writes one `prefixreg-call` line per
call (hashes and counts, no text), and `prefixreg audit` of that file gives the server's own
totals. End to end: a loop through the API (`Worker.chat`) against the simulator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

import prefixreg
from prefixreg.core.errors import UsageError
from prefixreg.server.calllog import read_call_record
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli

SYSTEM = "You are the repository's coding agent. Keep changes small and tested.\n" * 50
TURNS = 6


def loop(reg: prefixreg.Registry, url: str, log: Path, *, tenant: bool) -> list[Any]:
    """The README's loop: a growing history sent with `Worker.chat`, each call recorded."""
    head = reg.head("loop")
    session = prefixreg.Session(head, call_log=log)
    evidence, history = [], []
    with prefixreg.Worker(url) as w:
        for turn in range(TURNS):
            history.append({"role": "user", "content": f"step {turn}: fix test {turn} " * 30})
            _reply, ev = w.chat(head, history=history, max_tokens=8)
            session.sent(head.body(history, max_tokens=8), ev)
            evidence.append(ev)
            history.append({"role": "assistant", "content": f"done {turn}"})
            if tenant:
                for k in range(3):
                    w.chat(f"another tenant {turn} {k} " * 200, "go", max_tokens=1)
    return evidence


def test_audit_of_a_loops_call_log_gives_the_servers_totals_exactly(tmp_path: Path) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    log = tmp_path / "calls.jsonl"
    with SimServer(SimConfig(speed=1000, counter_lag=0)) as sim:
        evidence = loop(reg, sim.url, log, tenant=False)
        counters = httpx.get(f"{sim.url}/cache").json()
    lines = log.read_bytes().splitlines()
    assert len(lines) == TURNS
    assert SYSTEM.split()[3].encode() not in log.read_bytes()  # no prompt text in the log
    assert all(not isinstance(read_call_record(orjson.loads(x)), str) for x in lines)
    res = run_cli("audit", str(log), "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == TURNS and out["malformed"] == [] and out["skipped"] == []
    tokens = out["tokens"]
    assert tokens["prompt"]["total"] == sum(ev.prompt_tokens for ev in evidence)
    assert tokens["cached"]["total"] == sum(ev.cached_tokens for ev in evidence)
    assert tokens["completion"]["total"] == sum(ev.completion_tokens for ev in evidence)
    # The server's own counters over the same calls (no lag here): what caching saved.
    assert tokens["cached"]["total"] == counters["prompt_tokens_saved"]
    assert counters["hits"] + counters["misses"] == TURNS
    assert out["states"]["unverified"] == 0 and out["states"]["reused"] == TURNS - 1
    assert out["system_prefix"]["identical"] == TURNS
    assert out["system_prefix"]["batch_prefix"]["names"] == ["loop"]
    # Each call resumed the previous one's prompt: of the session, only the previous prompt's
    # closing template tokens (its generation prompt, which the next prompt does not repeat:
    # 7 on the simulator) are uncached.
    assert out["saving"]["uncached"]["session"] <= 7 * (TURNS - 1)
    assert out["saving"]["uncached"]["session"] < out["saving"]["uncached"]["new_history"]


def test_a_loop_whose_history_a_tenant_evicts_shows_the_lost_session_in_its_log(
    tmp_path: Path,
) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    log = tmp_path / "calls.jsonl"
    with SimServer(SimConfig(speed=1000, max_entries=4)) as sim:
        evidence = loop(reg, sim.url, log, tenant=True)
    out = orjson.loads(run_cli("audit", str(log), "--json").stdout)
    assert out["tokens"]["prompt"]["total"] == sum(ev.prompt_tokens for ev in evidence)
    u = out["saving"]["uncached"]
    assert u["session"] > u["new_history"] and out["saving"]["lever"]["verdict"] == "lever"


def test_a_frame_loop_records_its_frame_and_audit_judges_against_it(tmp_path: Path) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="system")
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    frame = reg.add_frame("system", tools=orjson.dumps(tools).decode(), name="loop")
    log = tmp_path / "calls.jsonl"
    with SimServer(SimConfig(speed=1000)) as sim:
        loop(reg, sim.url, log, tenant=False)
    record = orjson.loads(log.read_bytes().splitlines()[0])
    assert record["head"]["kind"] == "frame" and record["head"]["sha256"] == frame
    out = orjson.loads(run_cli("audit", str(log), "--registry", str(reg.root), "--json").stdout)
    assert out["calls"] == TURNS and out["malformed"] == []
    assert out["states"]["reused"] == TURNS - 1


def test_a_call_log_needs_the_evidence_and_a_place_for_a_file(tmp_path: Path) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    head = reg.head("loop")
    session = prefixreg.Session(head, call_log=tmp_path / "calls.jsonl")
    with pytest.raises(UsageError, match="evidence"):
        session.sent(head.body([{"role": "user", "content": "hi"}]))
    assert not (tmp_path / "calls.jsonl").exists() and session.calls == 0
    with pytest.raises(UsageError, match="directory"):
        prefixreg.Session(head, call_log=tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        prefixreg.Session(head, call_log=tmp_path / "no" / "calls.jsonl")
    before = (reg.root / "names.log").read_bytes()
    with pytest.raises(UsageError):  # never a file of the registry's own
        prefixreg.Session(head, call_log=reg.root / "names.log")
    assert (reg.root / "names.log").read_bytes() == before


def test_a_hand_edited_call_record_is_listed_malformed_not_read(tmp_path: Path) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    log = tmp_path / "calls.jsonl"
    with SimServer(SimConfig(speed=1000)) as sim:
        loop(reg, sim.url, log, tenant=False)
    first = orjson.loads(log.read_bytes().splitlines()[0])
    bad = [first, first | {"chain": ["xyz"]}, first | {"version": 2}, first | {"evidence": {}}]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(b) for b in bad) + b"\n")
    out = orjson.loads(run_cli("audit", str(path), "--json").stdout)
    assert out["calls"] == 1
    reasons = [m["reason"] for m in out["malformed"]]
    assert len(reasons) == 3 and "chain is not a list" in reasons[0]
    assert "version 2" in reasons[1] and "corrupt evidence" in reasons[2]


def test_the_call_log_doors_name_a_wrong_argument(tmp_path: Path) -> None:
    reg = prefixreg.Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    head = reg.head("loop")
    body = head.body([{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="evidence"):
        prefixreg.call_record(body, {"prompt_tokens": 1})  # type: ignore[arg-type]
    with pytest.raises(prefixreg.ArgumentTypeError, match="body"):
        prefixreg.call_line("not a body", None)  # type: ignore[arg-type]
    with pytest.raises(prefixreg.ArgumentTypeError, match="call_log"):
        prefixreg.Session(head, call_log=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NUL"):
        prefixreg.Session(head, call_log="a\0b")

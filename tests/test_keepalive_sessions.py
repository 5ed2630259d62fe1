"""keepalive keeps the loop's session (head and history), not only its head (issue 23),
against the simulator: `track(body)` in process, `--session FILE` across processes, the
cost rule and its back-off, and the summary on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg import Session
from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame, Head
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.keepalive.session import SessionFile
from prefixreg.verbs.keepalive.state import rewarm_pays
from tests.conftest import run_cli
from tests.test_keepalive import SYSTEM, Foreign

ROOT = Path(__file__).resolve().parent.parent
TOOL_RESULT = "test_parser.py::test_roundtrip FAILED at line 42: expected 3, got 4\n" * 40


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(SYSTEM, name="loop")
    return registry


def next_turn(history: list[dict[str, Any]], turn: int) -> None:
    """The loop's next turn: the assistant's tool call, then the tool's result (~2.7 KB)."""
    history.append({"role": "assistant", "content": f"Running the tests, step {turn}."})
    history.append({"role": "user", "content": f"Tool result {turn}:\n{TOOL_RESULT}"})


def agent_loop(
    url: str,
    head: Head,
    keeper: KeepAlive | None,
    *,
    turns: int,
    foreign: int,
    log: Path | None = None,
    touch: bool = False,
) -> list[CallEvidence]:
    """`turns` loop calls, each with a longer history, `foreign` prompts before each; the
    keeper steps after each foreign prompt and tracks each call once it returned (or the
    loop appends its body to `log`)."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    out, tenant = [], Foreign(url)
    session = Session(head, keeper=None if log is not None or touch else keeper, log=log)
    try:
        with Worker(url) as loop:
            for turn in range(turns):
                for _ in range(foreign):
                    tenant.send()
                    if keeper is not None:
                        keeper.step()
                body = session.body(history, max_tokens=4)
                _, ev = loop.chat(head, history=history, max_tokens=4)
                out.append(ev)
                session.sent(body)
                if keeper is not None and touch:
                    keeper.touch(head.sha256)
                if keeper is not None:
                    keeper.step()
                next_turn(history, turn)
    finally:
        tenant.close()
    return out


def resumed_share(evs: list[CallEvidence]) -> float:
    return sum(ev.cached_tokens or 0 for ev in evs) / sum(ev.prompt_tokens or 0 for ev in evs)


def test_a_tracked_session_is_kept_whole(sim: SimServer, reg: Registry) -> None:
    head = reg.get("loop")
    with Worker(sim.url, timeout=2.0) as kw:
        without = agent_loop(sim.url, head, None, turns=6, foreign=5)
        keeper = KeepAlive(kw, [head])
        keeper.step()
        evs = agent_loop(sim.url, head, keeper, turns=6, foreign=5)
    # The session: every call after the first resumes all but the newest turn.
    for before, ev in pairwise(evs):
        assert ev.cached_tokens is not None and before.prompt_tokens is not None
        assert ev.cached_tokens >= before.prompt_tokens - 16, (before, ev)
    assert resumed_share(evs) > 0.75 > resumed_share(without)
    s = keeper.summary
    assert s.sessions >= 5 and s.resumed >= s.rewarms - 1 and s.backoffs == 0, str(s)
    assert "re-touched the loop's session" in str(s)


def test_track_refuses_a_body_of_no_kept_head(sim: SimServer, reg: Registry) -> None:
    head = reg.get("loop")
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head])
        other = {"messages": [{"role": "system", "content": "another prompt"}]}
        with pytest.raises(Exception, match="none of the kept heads"):
            keeper.track(other)
        bad = head.body([]) | {"messages": [*head.body([])["messages"], {"content": "x"}]}
        with pytest.raises(Exception, match="none of the kept heads"):
            keeper.track(bad)  # a message without a role: nothing the keeper could re-send
        assert keeper.track(head.body([])) == head.sha256  # the head alone is a session too
        assert keeper.track(head.body([{"role": "user", "content": "hi"}])) == head.sha256


def test_rewarm_pays_weighs_tokens_kept_warm_against_prefill_spent() -> None:
    assert rewarm_pays([]) == (True, "0 re-warms measured")
    assert rewarm_pays([(0, 1400), (0, 1400)])[0]  # too few to say no
    assert rewarm_pays([(1360, 15)] * 3)[0]
    pays, why = rewarm_pays([(0, 1400)] * 3)
    assert not pays and why == (
        "0 of the last 3 re-warms kept; 0 tokens kept warm <= 4,200 tokens of prefill spent"
    )
    assert not rewarm_pays([(1360, 15), (0, 1366)] * 2)[0]  # half partial: more spent
    assert rewarm_pays([(1360, 15), (1360, 15), (0, 1366)])[0]
    assert rewarm_pays([(0, 1400)] * 3 + [(1360, 15)] * 6)[0]  # only the last 6 count
    # Known evicted: re-prefilled, it saves the loop's next call at most what it spends.
    assert rewarm_pays([(1360, 15)] * 6, evicted=True) == (
        False,
        "evicted: a re-prefill would spend what the loop's next call saves",
    )


def test_a_keeper_that_cannot_help_backs_off_and_says_why(sim: SimServer, reg: Registry) -> None:
    # Foreign prompts flood the 8-entry LRU between two polls: every re-warm comes back
    # cold, so re-warming only adds prefill. The keeper stops after a few and says why.
    head = reg.get("loop")
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head], budget=2)
        keeper.step()
        tenant = Foreign(sim.url)
        try:
            for _ in range(12):
                tenant.send(8)
                keeper.step()
        finally:
            tenant.close()
    s = keeper.summary
    assert s.cold == 4 and s.rewarms == 4 and s.backoffs == 1, str(s)
    assert s.backoff_reason is not None and s.backoff_reason.startswith("0 of the last 3")
    assert "backed off 1 times (0 of the last 3 re-warms kept" in str(s)


def test_a_long_loops_session_file_is_read_on_never_whole(tmp_path: Path) -> None:
    """A file past the 64 MiB user-file cap: each read takes only what was appended."""
    path = tmp_path / "session.jsonl"
    sf = SessionFile(path)
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (1 << 20) + b'"}]}\n'
    with path.open("ab") as f:
        for i in range(70):  # 70 MiB in all, a line at a time, as a loop appends
            f.write(body)
            f.flush()
            new, latest = sf.read()
            assert new == 1 and isinstance(latest, dict), i
    assert path.stat().st_size > 64 << 20
    late = SessionFile(path)  # a keeper started (or restarted) on that file: its last lines
    new, latest = late.read()
    assert 0 < new < 70 and latest == orjson.loads(body)
    with path.open("ab") as f:
        f.write(b'{"messages": []}\n')
    assert late.read() == (1, {"messages": []})


def test_session_file_reads_complete_lines_and_refuses_a_fifo(
    reg: Registry, tmp_path: Path
) -> None:
    path = tmp_path / "session.jsonl"
    sf = SessionFile(path)
    assert sf.read() == (0, None)  # the loop has not called yet
    path.write_bytes(b'{"messages": []}\n{"messages": [1]}\n{"half": ')
    assert sf.read() == (2, {"messages": [1]})
    assert sf.read() == (0, None)
    with path.open("ab") as f:
        f.write(b'"line"}\nnot json\n')
    assert sf.read() == (2, None)  # the latest line is not JSON
    path.write_bytes(b'{"a": 1}\n')  # truncated by the loop: start over
    assert sf.read() == (1, {"a": 1})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(Exception, match="not a regular file"):
        SessionFile(fifo)
    with pytest.raises(UsageError, match="fifo"):  # no reader: refused, never waited on
        Session(reg.get("loop"), log=fifo).sent({"messages": []})
    with pytest.raises(UsageError, match="a directory"):
        Session(reg.get("loop"), log=tmp_path).sent({"messages": []})
    res = run_cli(
        *("keepalive", "loop", "--session", str(fifo), "--registry", str(reg.root)),
        *("--worker", "http://127.0.0.1:9"),  # refused before any connection
    )
    assert res.returncode == 2 and b"not a regular file" in res.stderr, res.stderr


def test_cli_session_file_keeps_the_session_and_sigterm_prints_the_summary(
    sim: SimServer, reg: Registry, tmp_path: Path
) -> None:
    log = tmp_path / "session.jsonl"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "prefixreg", "keepalive", "loop", "--worker", sim.url),
            *("--registry", str(reg.root), "--session", str(log), "--poll", "0.02"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        time.sleep(2.0)  # started, first warm sent
        head = reg.get("loop")
        # The keeper polls every 20 ms; the loop gives it room between foreign prompts.
        history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        evs, tenant = [], Foreign(sim.url)
        with Worker(sim.url) as loop:
            for turn in range(5):
                for _ in range(5):
                    tenant.send()
                    time.sleep(0.15)
                _, ev = loop.chat(head, history=history, max_tokens=4)
                evs.append(ev)
                Session(head, log=log).sent(head.body(history, max_tokens=4))
                time.sleep(0.15)
                next_turn(history, turn)
        tenant.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert b"re-touched the loop's session" in out, out
    assert b"Traceback" not in err
    for before, ev in pairwise(evs[1:]):
        assert ev.cached_tokens is not None and before.prompt_tokens is not None
        assert ev.cached_tokens >= before.prompt_tokens - 16, (before, ev)


def test_on_the_simulator_the_turn_time_stays_flat_with_the_session_kept(
    reg: Registry,
) -> None:
    # Issue 23's acceptance: the loop's turn time from turn 2 to turn 8 grows by at most
    # 1.5x with its session kept; with its head alone kept, the history is re-prefilled.
    head = reg.get("loop")
    walls: dict[str, list[float]] = {}
    for mode in ("head", "session"):
        with SimServer(SimConfig(speed=20)) as slow, Worker(slow.url, timeout=5.0) as kw:
            keeper = KeepAlive(kw, [head])
            keeper.step()
            # "head": the loop's calls are uses (touch), its history is not kept.
            evs = agent_loop(slow.url, head, keeper, turns=8, foreign=5, touch=mode == "head")
        walls[mode] = [ev.wall_s or 0.0 for ev in evs]
    assert walls["session"][7] <= 1.5 * walls["session"][1], walls
    assert walls["head"][7] > 2 * walls["head"][1], walls


def test_keepalive_on_a_pool_keeps_each_head_on_the_worker_that_holds_it(
    reg: Registry, tmp_path: Path
) -> None:
    reg.add("Another loop's system prompt, kept on another worker.\n" * 60, name="other")
    with SimServer(SimConfig(speed=5000)) as one, SimServer(SimConfig(speed=5000)) as two:
        pool = tmp_path / "pool.json"
        workers = [{"url": one.url, "capacity": 1}, {"url": two.url, "capacity": 1}]
        pool.write_bytes(orjson.dumps({"workers": workers}))
        root = str(reg.root)
        warmed = run_cli("pool", "warm", "loop", "other", "--pool", str(pool), "--registry", root)
        assert warmed.returncode == 0, warmed.stdout + warmed.stderr
        placed = orjson.loads(pool.with_name("pool.json.placement.json").read_bytes())
        prom = tmp_path / "keepalive.prom"
        res = run_cli(
            *("keepalive", "loop", "other", "--pool", str(pool), "--registry", root),
            *("--duration", "0.5", "--poll", "0.05", "--json", "--metrics-file", str(prom)),
        )
        missing = run_cli("keepalive", "loop", "--pool", str(tmp_path / "none.json"))
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert sorted(w["worker"] for w in out["workers"]) == sorted([one.url, two.url])
    assert all(w["rewarms"] >= 1 for w in out["workers"])
    # One metrics file for every keeper, each worker's counters under its own label.
    text = prom.read_text()
    assert text.count("# TYPE prefixreg_rewarms_total counter") == 1
    for w in out["workers"]:
        lines = [ln for ln in text.splitlines() if ln.startswith("prefixreg_rewarms_total{")]
        mine = [ln for ln in lines if f'worker="{w["worker"]}"' in ln]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in mine) == w["rewarms"]
    where = {e["sha256"]: e["worker"] for e in placed["entries"]}
    kept = [m for m in reg.measurements() if m.kind == "keepalive"]
    assert {m.sha256 for m in kept} == set(where)
    assert all(m.worker == where[m.sha256] for m in kept)  # each on the worker holding it
    assert missing.returncode == 2


def test_a_frames_session_is_kept_whole_through_the_openai_kwargs(
    sim: SimServer, reg: Registry
) -> None:
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    reg.add_frame("loop", tools=orjson.dumps(tools), name="agent")
    frame = reg.head("agent")
    assert isinstance(frame, Frame)
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [frame, reg.head("loop")])  # the frame is matched first
        keeper.step()
        history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
        next_turn(history, 0)
        # As an openai SDK loop sends it: settings the SDK does not name go in extra_body.
        with Worker(sim.url) as loop:
            loop.chat(frame, history=history, max_tokens=4)
        assert keeper.track(frame.openai_kwargs(history, model="m")) == frame.sha256
        keeper.step()  # the poll after the loop's call
        done, tenant = [], Foreign(sim.url)
        for _ in range(4):
            tenant.send()
            done += keeper.step()
        tenant.close()
    rewarm = next(r for r in done if r.frame == frame.sha256)
    assert rewarm.verdict == "resumed" and keeper.summary.sessions >= 1
    assert rewarm.record.evidence.prompt_tokens is not None
    # The whole session was re-touched: more than the head's tokens came from the cache.
    assert (rewarm.record.evidence.cached_tokens or 0) > 0.9 * rewarm.record.evidence.prompt_tokens


def test_a_loop_call_still_running_in_its_slot_is_polled_at_the_poll_interval(
    reg: Registry,
) -> None:
    """llama.cpp: while the loop's own call runs in the head's slot, the keeper waits for the
    slot to count it at its poll interval; it never polls nonstop (that would slow the call)."""
    from tests.fakeserver import FakeServer, Reply
    from tests.test_snapshots import PROPS

    state = {"busy": False, "chats": 0}

    def task(i: int) -> int:  # slot 0 takes every chat: its task id moves on
        return 50 + i + (state["chats"] if i == 0 else 0)

    def slots(_req: object) -> Reply:
        busy = state["busy"]
        return Reply(
            json=[
                {"id": i, "n_ctx": 8192, "is_processing": busy and i == 0, "id_task": task(i)}
                for i in (0, 1)
            ]
        )

    def chat(_req: object) -> Reply:
        state["chats"] += 1
        usage = {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}
        choice = {"index": 0, "finish_reason": "length", "message": {"content": "x"}}
        return Reply(
            json={
                "choices": [choice],
                "usage": usage | {"prompt_tokens_details": {"cached_tokens": 0}},
                "timings": {"cache_n": 0, "prompt_n": 1000},
            }
        )

    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json={"status": "ok"}))
        srv.route("GET", "/props", Reply(json={**PROPS, "total_slots": 2}))
        srv.route("GET", "/slots", slots)
        srv.route("POST", "/v1/chat/completions", chat)
        with Worker(srv.url, timeout=5.0) as w:
            keeper = KeepAlive(w, [reg.get("loop")], registry=reg, budget=4, poll_s=0.25)
            keeper.step()  # its first warm lands in slot 0
            state["busy"] = True  # the loop's own call now runs there
            keeper.touch(reg.get("loop").sha256)
            before = sum(r.path == "/slots" for r in srv.requests)
            keeper.run(1.0)
            polled = sum(r.path == "/slots" for r in srv.requests) - before
    assert polled <= 12, polled  # about 4 polls (plus a re-warm's own reads), never hundreds


def test_a_first_ctrl_c_lets_the_re_warm_in_flight_finish_a_second_interrupts_it(
    reg: Registry,
) -> None:
    """Ctrl-C only sets a flag (the keeper stops after the re-warm in flight); a second one
    interrupts that call, and the summary still prints, with no traceback."""
    from tests.fakeserver import FakeServer, Reply

    with FakeServer() as srv:
        srv.route("GET", "/v1/models", Reply(json={"object": "list", "data": [{"id": "m"}]}))
        srv.route("POST", "/v1/chat/completions", Reply(json={}, delay=60.0))  # a slow prefill
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "prefixreg", "keepalive", "loop", "--worker", srv.url),
                *("--registry", str(reg.root), "--interval", "1", "--poll", "0.05"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 30
        while not any(r.path == "/v1/chat/completions" for r in srv.requests):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)  # the first warm is in flight
        proc.send_signal(signal.SIGINT)
        time.sleep(1.5)
        assert proc.poll() is None  # it waits for the re-warm in flight
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)  # the second one interrupts it
    assert b"Traceback" not in err, err
    assert b"re-warms:" in out, (out, err)


def test_a_body_adding_tools_to_a_bare_prefix_is_refused_never_kept_without_them(
    sim: SimServer, reg: Registry, tmp_path: Path
) -> None:
    # Before (issue 33): kept as the prefix's session, then re-warmed without its tools: a
    # prompt the loop never sends, counted kept.
    head = reg.head("loop")
    tools = [{"type": "function", "function": {"name": "run_tests", "parameters": {}}}]
    history = [{"role": "user", "content": "Fix the failing test."}]
    with_tools = head.body(history) | {"tools": tools}
    with_setting = head.body(history) | {"extra_body": {"tool_choice": "auto"}}
    log = tmp_path / "s.jsonl"
    log.write_bytes(orjson.dumps(with_tools) + b"\n")
    log.chmod(0o600)
    notes: list[str] = []
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head])
        for body, field in ((with_tools, "tools"), (with_setting, "tool_choice")):
            with pytest.raises(UsageError, match=f"with {field}, which a bare prefix cannot"):
                keeper.track(body)
        assert all(k.session is None for k in keeper.state.kept.values())
        assert keeper.track(head.body(history)) == head.sha256  # without them: its session
        from_file = KeepAlive(kw, [head], session=log, on_note=notes.append)
        from_file.step()
        from_file.step()
    assert all(k.session is None for k in from_file.state.kept.values())
    assert from_file.summary.session_skipped == 1
    assert len(notes) == 1 and "register them with the prefix as a frame" in notes[0], notes
    # The loop's own side refuses it before writing a line another keeper would skip.
    fresh = tmp_path / "fresh.jsonl"
    for body in (with_tools, with_setting):
        with pytest.raises(UsageError, match=r"Session\.sent\(\): the body sends prefix"):
            Session(head, log=fresh).sent(body)
    assert not fresh.exists()
    tools_file = tmp_path / "tools.json"
    tools_file.write_bytes(orjson.dumps(tools))
    frame = reg.head(reg.add_frame("loop", tools=tools_file.read_bytes()))
    Session(frame, log=fresh).sent(frame.body(history))  # a frame keeps its tools: taken
    assert fresh.read_bytes().count(b"\n") == 1

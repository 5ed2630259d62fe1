"""keepalive when its re-warms fail, a first warm on time, and what `track`, `Session` and
`--session` refuse: real loopback servers, real files, real processes."""

from __future__ import annotations

import math
import os
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
from prefixreg.core.frame import Head
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.keepalive.session import SessionFile
from prefixreg.verbs.keepalive.state import MAX_FAILURES
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request
from tests.test_keepalive import SYSTEM, Foreign

ROOT = Path(__file__).resolve().parent.parent
BAD_TURN = [{"role": "user", "content": 123}]  # JSON, but no chat server takes it: HTTP 400


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    registry = Registry(tmp_path / "reg")
    registry.add(SYSTEM, name="loop")
    return registry


def session_file(path: Path, head: Head, history: list[dict[str, Any]], mode: int = 0o600) -> Path:
    path.write_bytes(orjson.dumps(head.body(history, max_tokens=4)) + b"\n")
    path.chmod(mode)
    return path


# -- a re-warm the worker keeps refusing backs off, then drops the session, then the head --


def test_a_session_the_worker_refuses_backs_off_and_is_dropped(
    sim: SimServer, reg: Registry
) -> None:
    head = reg.get("loop")
    notes: list[str] = []
    tenant = Foreign(sim.url)
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head], budget=1, poll_s=0.01, on_note=notes.append)
        keeper.track(head.body(BAD_TURN))
        steps, deadline = 0, time.monotonic() + 1.5
        while time.monotonic() < deadline:  # every poll is answered, the head due at each
            tenant.send()
            keeper.step()
            steps += 1
            time.sleep(0.01)
    tenant.close()
    s = keeper.summary
    # Before: one failing POST at every answered poll, for ever (each poll ended the streak).
    assert s.errors == MAX_FAILURES < steps // 4, (s.errors, steps)
    assert notes == s.dropped and len(notes) == 1, notes
    assert "5 re-warms in a row failed" in notes[0] and "HTTP 400" in notes[0]
    assert "session dropped, re-warmed with a fresh tail" in notes[0]
    # The head itself is kept from then on (a fresh tail), and the run is not stopped.
    assert s.resumed >= 3 and s.sessions == 0 and s.stopped_because is None, str(s)
    assert keeper.history[-1].verdict == "resumed"
    assert notes[0] in str(s)


def _always_400(srv: FakeServer, times: list[float]) -> None:
    """A server without /cache (time interval) that refuses every chat request."""

    def chat(_req: Request) -> Reply:
        times.append(time.monotonic())
        error = {"error": {"message": "content must be a string", "type": "invalid_request"}}
        return Reply(status=400, json=error)

    srv.route("GET", "/v1/models", Reply(json={"data": [{"id": "m"}]}))
    srv.route("POST", "/v1/chat/completions", chat)


def test_cli_a_head_whose_rewarms_keep_failing_is_given_up_with_back_off(
    reg: Registry, tmp_path: Path
) -> None:
    head = reg.get("loop")
    log = session_file(tmp_path / "s.jsonl", head, [{"role": "user", "content": "hi"}])
    times: list[float] = []
    with FakeServer() as srv:
        _always_400(srv, times)
        started = time.monotonic()
        res = run_cli(
            *("keepalive", "loop", "--worker", srv.url, "--registry", str(reg.root)),
            *("--session", str(log), "--interval", "0.01", "--poll", "0.02"),
            *("--duration", "20s"),
            timeout=60,
        )
        took = time.monotonic() - started
    err = res.stderr.decode()
    # The session's five, then the fresh tail's five: the head is given up, the run stops.
    assert len(times) == 2 * MAX_FAILURES, (len(times), err)
    assert res.returncode == 5 and took < 15, (res.returncode, took, err)
    assert err.count("its session dropped") == 1 and err.count("no longer kept") == 1, err
    assert "stopped: every kept head given up" in err and "Traceback" not in err
    assert "HTTP 400" in err and "content must be a string" in err
    gaps = [b - a for a, b in pairwise(times)]
    for streak in (gaps[:4], gaps[5:]):  # each streak's waits double (poll x 2, x 4, ...)
        for i, gap in enumerate(streak):
            assert gap >= 0.02 * 2 ** (i + 1) * 0.9, (i, gaps)
    assert b"no longer kept" in res.stdout  # the summary says it too


# -- a first warm on a time interval is a first warm, never "after <uptime> seconds" ------


def test_dense_first_warm_on_time_has_no_since(reg: Registry) -> None:
    # Dense caches in multiples of 2,048 tokens: a head of fewer is never cached at all.
    reg.add(SYSTEM * 3, name="dense-loop")
    config = SimConfig.for_profile("dense", speed=5000)
    with SimServer(config) as sim, Worker(sim.url) as w:
        keeper = KeepAlive(w, [reg.get("dense-loop")], registry=reg, interval_s=0.05)
        assert keeper.budget.unit == "seconds"
        first = keeper.step()
        time.sleep(0.06)
        second = keeper.step()
        res = run_cli(
            *("keepalive", "dense-loop", "--worker", sim.url, "--registry", str(reg.root)),
            *("--interval", "60", "--duration", "1s"),
        )
    # Before: since was the machine's uptime (now - 0.0), which the budget would learn from.
    assert [r.since for r in first] == [None]
    assert second[0].since is not None and 0.05 <= second[0].since < 5
    assert not keeper.summary.budget_changes
    bodies = [m.body for m in reg.measurements() if m.kind == "keepalive"]
    assert bodies[0]["since_seconds"] is None
    assert isinstance(bodies[1]["since_seconds"], float)
    assert res.returncode == 0, res.stderr
    assert b"(first warm)" in res.stderr and b"(after " not in res.stderr, res.stderr


# -- track and Session refuse what they could not re-send or write, before anything --------


def test_track_refuses_a_body_it_could_not_resend(sim: SimServer, reg: Registry) -> None:
    head = reg.get("loop")
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head], poll_s=0.01)
        for bad in (
            head.body([{"role": "user", "content": object()}]),
            {
                **head.body([{"role": "user", "content": "x"}]),
                "temperature": math.nan,
            },  # body() refuses
            head.body([{"role": "user", "content": "x"}], seed=2**70),
        ):
            with pytest.raises(UsageError, match=r"track\(\): the request is not JSON"):
                keeper.track(bad)
        wrong: Any
        for wrong in (None, "x", [("messages", [])]):
            with pytest.raises(UsageError, match="request body"):
                keeper.track(wrong)
        assert all(k.session is None for k in keeper.state.kept.values())
        summary = keeper.run(0.3)  # before: the thread stopped on a UsageError from chat()
    assert summary.stopped_because is None and summary.rewarms == 1, str(summary)


def test_session_refuses_wrong_types_before_telling_or_writing(
    sim: SimServer, reg: Registry, tmp_path: Path
) -> None:
    head = reg.get("loop")
    log = tmp_path / "s.jsonl"
    wrong: list[dict[str, Any]] = [{"log": 5}, {"log": "a\0b"}, {"calls": "x"}]
    for kwargs in [*wrong, {"calls": -1}, {"calls": 1.5}]:
        with pytest.raises(UsageError, match="Session: "):
            Session(head, **kwargs)
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head])
        session = Session(head, keeper=keeper, log=log)
        bad: Any
        for bad in (
            None,
            [("messages", [])],
            {"model": "m"},
            {
                **head.body([{"role": "user", "content": "x"}]),
                "temperature": math.nan,
            },  # body() refuses
            head.body([{"role": "user", "content": object()}]),
            head.body([{"role": "user", "content": "x"}], seed=2**70),
        ):
            with pytest.raises(UsageError, match=r"Session\.sent\(\)"):
                session.sent(bad)
        assert all(k.session is None for k in keeper.state.kept.values())  # not tracked
    assert not log.exists() and session.calls == 0
    session.keeper = None
    session.sent(head.body([{"role": "user", "content": "hi"}]))
    assert session.calls == 1 and log.read_bytes().count(b"\n") == 1


_FULL_DISK = """
import os, resource, signal, sys
from prefixreg.core.errors import UsageError
from prefixreg.registry.store import Registry
from prefixreg.verbs.loop import Session
log, head = sys.argv[1], Registry(sys.argv[2]).get("loop")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
size = os.path.getsize(log)
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, size + 100))  # room for 100 bytes
try:
    Session(head, log=log).sent(head.body([{"role": "user", "content": "x" * 1000}]))
except UsageError as exc:
    print("refused:", exc)
"""


def test_session_on_a_full_disk_writes_no_partial_line(reg: Registry, tmp_path: Path) -> None:
    head = reg.get("loop")
    log = session_file(tmp_path / "s.jsonl", head, [{"role": "user", "content": "first"}])
    before = log.read_bytes()
    res = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(log), str(reg.root)],
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )
    # Before: a raw OSError, and 100 bytes of a line the reader would glue the next one onto.
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr
    assert res.stdout.startswith(b"refused: ") and b"not written" in res.stdout, res.stdout
    assert log.read_bytes() == before


# -- a session file another local user could write is refused --------------------------


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_session_file_others_can_write_is_refused(
    reg: Registry, tmp_path: Path, mode: int
) -> None:
    head = reg.get("loop")
    log = session_file(tmp_path / "s.jsonl", head, [{"role": "user", "content": "hi"}], mode)
    res = run_cli(
        *("keepalive", "loop", "--session", str(log), "--registry", str(reg.root)),
        *("--worker", "http://127.0.0.1:9"),  # refused before any connection
    )
    assert res.returncode == 2, res.stderr
    assert b"group- or world-writable" in res.stderr and b"Traceback" not in res.stderr
    with pytest.raises(UsageError, match="group- or world-writable"):
        Session(head, log=log).sent(head.body([]))  # the loop does not feed it either
    log.chmod(0o600)
    assert SessionFile(log).read()[0] == 1


def test_a_session_file_of_another_user_is_refused(reg: Registry, tmp_path: Path) -> None:
    head = reg.get("loop")
    log = session_file(tmp_path / "s.jsonl", head, [{"role": "user", "content": "hi"}])
    if os.geteuid() == 0:  # root too refuses another user's file
        os.chown(log, 65534, 65534)
    else:
        log = Path("/etc/passwd")  # a real file of root's
    with pytest.raises(UsageError, match="not by this user"):
        SessionFile(log)
    res = run_cli(
        *("keepalive", "loop", "--session", str(log), "--registry", str(reg.root)),
        *("--worker", "http://127.0.0.1:9"),
    )
    assert res.returncode == 2 and b"not by this user" in res.stderr, res.stderr


def test_a_session_file_made_writable_later_stops_the_keeper(
    sim: SimServer, reg: Registry, tmp_path: Path
) -> None:
    head = reg.get("loop")
    log = session_file(tmp_path / "s.jsonl", head, [{"role": "user", "content": "hi"}])
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [head], session=log, poll_s=0.01)
        keeper.step()
        log.chmod(0o666)  # another user could append bodies the keeper would re-send now
        summary = keeper.run(2.0)
    assert summary.stopped_because is not None
    assert "group- or world-writable" in summary.stopped_because


def test_a_worker_that_went_away_is_no_fault_of_the_session(reg: Registry) -> None:
    # Unreachable is the worker's: five such errors stop the keeper (its invariant), and the
    # loop's session is kept, never dropped as if the worker had refused it.
    head = reg.get("loop")
    sim = SimServer(SimConfig.for_profile("dense", speed=5000)).start()
    with Worker(sim.url, timeout=1.0) as kw:
        keeper = KeepAlive(kw, [head], interval_s=0.01, poll_s=0.01)
        keeper.track(head.body([{"role": "user", "content": "go on"}]))
        keeper.step()  # the first warm, answered
        sim.stop()
        for _ in range(4 * MAX_FAILURES):  # the server is gone now
            time.sleep(0.02)
            keeper.step()
            if keeper.summary.stopped_because is not None:
                break
    s = keeper.summary
    assert s.stopped_because == "5 worker errors in a row" and s.stopped_by_worker, str(s)
    assert s.dropped == [] and all(k.session is not None for k in keeper.state.kept.values())


# -- issue 33 item 8: a copies count checked on the numbers before anything is built ----------

_HUGE_COPIES = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # 1 GiB: building copies runs out
from prefixreg.core.errors import UsageError
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.run import KeepAlive
head = Registry(sys.argv[2]).head("loop")
try:
    KeepAlive(Worker(sys.argv[1]), [head], copies=10**12)
except UsageError as exc:
    print("refused:", exc)
"""


def _llamacpp_with_two_slots(srv: FakeServer) -> None:
    props = {"build_info": "b1-two", "model_path": "/m.gguf", "total_slots": 2}
    props |= {"default_generation_settings": {"n_ctx": 8192}, "chat_template": "{{ messages }}"}
    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json=props))
    slots = [{"id": i, "n_ctx": 4096, "is_processing": False, "id_task": -1} for i in range(2)]
    srv.route("GET", "/slots", Reply(json=slots))
    srv.route("GET", "/metrics", Reply(status=501, json={"error": {"message": "off"}}))


def test_a_huge_copies_count_is_refused_before_any_entry_is_built(
    sim: SimServer, reg: Registry
) -> None:
    # Before: one entry per copy was built first (10**12 of them: memory ran out).
    with FakeServer() as llama:
        _llamacpp_with_two_slots(llama)
        for url, says in ((llama.url, b"at most 2 copies"), (sim.url, b"one per slot")):
            res = subprocess.run(
                [sys.executable, "-c", _HUGE_COPIES, url, str(reg.root)],
                capture_output=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                timeout=120,
                check=False,
            )
            assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr[-400:]
            assert res.stdout.startswith(b"refused: ") and says in res.stdout, res.stdout
            cli = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _CLI_LIMITED,
                    "keepalive",
                    "loop",
                    "--copies",
                    str(2**70),
                    "--worker",
                    url,
                    "--registry",
                    str(reg.root),
                    "--duration",
                    "1",
                ],
                capture_output=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                timeout=120,
                check=False,
            )
            assert cli.returncode == 2 and says in cli.stderr, cli.stderr[-400:]
            assert b"Traceback" not in cli.stderr


_CLI_LIMITED = """
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
sys.argv = ["prefixreg", *sys.argv[1:]]
runpy.run_module("prefixreg", run_name="__main__")
"""

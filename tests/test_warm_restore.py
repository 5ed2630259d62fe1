"""`prefixreg warm REF --restore` without a real engine: exit codes and what the output says.

A scripted loopback llama.cpp server (the `_llama` script of `test_snapshots.py`) answers
the slot API and the chat calls; the CLI runs as a real process. The real-engine acceptance
(save, restart, `warm --restore` exits 0 `restored`) is in `test_snapshot_llama.py`.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply
from tests.test_snapshots import RESTORED, _llama, saved_record
from tests.test_snapshots import reg as reg  # the registry fixture, reused


def warm_restore(reg: Registry, url: str, *args: str) -> tuple[int, bytes, bytes]:
    res = run_cli("warm", "p1", "--restore", "--worker", url, "--registry", str(reg.root), *args)
    return res.returncode, res.stdout, res.stderr


def slot_posts(srv: FakeServer) -> list[str]:
    return [r.path for r in srv.requests if r.method == "POST" and r.path.startswith("/slots")]


def test_a_proven_restore_exits_0_without_a_warm(reg: Registry, tmp_path: Path) -> None:
    sha = reg.resolve("p1")
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        saved_record(reg, srv.url, tmp_path / "slots")
        code, out, err = warm_restore(reg, srv.url, "--json")
        chats = [r for r in srv.requests if r.path == "/v1/chat/completions"]
    assert code == 0, err
    body = orjson.loads(out)
    assert body["verdict"] == "restored" and body["outcome"] == "restored"
    assert body["resumed_by"] == "restore" and body["fallback"] is None
    assert len(chats) == 1 and chats[0].json["id_slot"] == 0  # only the pinned check
    (m,) = reg.measurements(sha)
    assert m.kind == "restore" and m.body["verdict"] == "restored"


def test_a_restore_that_does_not_resume_says_so_and_the_warm_decides(
    reg: Registry, tmp_path: Path
) -> None:
    sha = reg.resolve("p1")
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=0)  # every call is served cold
        saved_record(reg, srv.url, tmp_path / "slots")
        code, out, err = warm_restore(reg, srv.url)
        jcode, jout, _ = warm_restore(reg, srv.url, "--json")
    assert code == 1, err  # the normal warm was cold: exit 1, as a plain warm
    text = out.decode()
    assert "verdict  NOT_RESTORED" in text
    assert "not restored; a normal warm followed (cold, exit 1)" in text
    assert "verdict  cold" in text.lower()
    body = orjson.loads(jout)
    assert jcode == 1 and body["verdict"] == "not_restored"
    assert body["outcome"] == "cold" and body["resumed_by"] is None
    kinds = sorted(m.kind for m in reg.measurements(sha))
    assert kinds.count("restore") == 2 and len(kinds) == 4  # each restore and each warm


def test_a_resumed_fallback_warm_exits_0_and_is_named_as_the_warm(
    reg: Registry, tmp_path: Path
) -> None:
    refused = Reply(status=400, json={"error": {"message": "failed to restore", "code": 400}})
    with FakeServer() as srv:
        _llama(srv, restore=refused, cached=990)
        saved_record(reg, srv.url, tmp_path / "slots")
        code, out, err = warm_restore(reg, srv.url, "--json")
    body = orjson.loads(out)
    assert code == 0, err
    assert body["verdict"] == "restore_failed" and "failed to restore" in body["reason"]
    assert body["outcome"] == "resumed" and body["resumed_by"] == "warm"


def test_no_snapshot_for_this_build_says_so_and_warms(reg: Registry) -> None:
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        code, out, err = warm_restore(reg, srv.url)
        posts = slot_posts(srv)
    assert code == 0, err
    assert "verdict  NO_SNAPSHOT: no snapshot of" in out.decode()
    assert "not restored; a normal warm followed (resumed, exit 0)" in out.decode()
    assert posts == []


def test_a_changed_snapshot_file_exits_3_and_sends_no_restore(
    reg: Registry, tmp_path: Path
) -> None:
    sha = reg.resolve("p1")
    slots = tmp_path / "slots"
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        record = saved_record(reg, srv.url, slots)
        ok, _, err_ok = warm_restore(reg, srv.url, "--json")
        assert ok == 0, err_ok  # the intact file restores
        (slots / record.file).write_bytes(b"kv" * 4999 + b"KV")
        before = len(reg.measurements(sha))
        srv.requests.clear()
        code, out, err = warm_restore(reg, srv.url, "--slot-dir", str(slots))
        posts = slot_posts(srv)
        chats = [r for r in srv.requests if r.path == "/v1/chat/completions"]
    assert code == 3, err
    assert b"does not match" in err and b"no restore sent" in err and out == b""
    assert posts == [] and chats == []
    assert len(reg.measurements(sha)) == before


def test_restore_on_a_server_without_a_slot_api_exits_2(reg: Registry) -> None:
    with SimServer(SimConfig(speed=2000)) as sim:
        code, out, err = warm_restore(reg, sim.url)
    assert code == 2 and b"not supported by this server's profile (halogen)" in err
    assert out == b"" and reg.measurements() == []


def test_restore_refuses_options_it_cannot_honour(reg: Registry, tmp_path: Path) -> None:
    for args in (("--no-check",), ("--check-only",)):
        code, _, err = warm_restore(reg, "http://127.0.0.1:9", *args)
        assert code == 2, (args, err)
    res = run_cli(
        "warm", "p1", "--slot-dir", str(tmp_path), "--worker", "http://127.0.0.1:9",
        "--registry", str(reg.root),
    )  # fmt: skip
    assert res.returncode == 2 and b"add --restore" in res.stderr


def test_warm_restore_of_a_frame_restores_the_frames_own_snapshot(
    reg: Registry, tmp_path: Path
) -> None:
    """#21: a frame's head has its own snapshot record, keyed by the frame's sha."""
    frame = reg.add_frame("p1", settings={"reasoning_effort": "low"}, name="loop")
    with FakeServer() as srv:
        _llama(srv, restore=Reply(json=RESTORED), cached=990)
        record = saved_record(reg, srv.url, tmp_path / "slots", ref="loop")
        res = run_cli("warm", "loop", "--restore", "--worker", srv.url, "--registry",
                      str(reg.root), "--json")  # fmt: skip
        (chat,) = [r.json for r in srv.requests if r.path == "/v1/chat/completions"]
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["verdict"] == "restored" and out["kind"] == "frame" and out["sha256"] == frame
    assert record.sha256 == frame and record.file == f"prefixreg-{frame}-{record.build_id}.bin"
    assert chat["reasoning_effort"] == "low" and chat["id_slot"] == 0  # the frame's head
    (m,) = reg.measurements(reg.resolve("p1"))
    assert m.kind == "restore" and m.outcome.frame == frame
    assert verify_registry(reg).ok  # a frame's record has its head: not dangling

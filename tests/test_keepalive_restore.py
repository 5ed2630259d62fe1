"""keepalive on llama.cpp: a prefix lost to a restart comes back from its proven snapshot.

A scripted loopback llama.cpp server: `/slots` shows `id_task` going backwards (how the
keeper's prompt counter sees a restart), the slot API answers the restore, and the chat
replies say what the cache held. The keeper's first re-warm is a cold prefill (measured),
so the restore's report can set its seconds against a measured cold call of that prefix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.verbs.keepalive.run import KeepAlive
from tests.fakeserver import FakeServer, Reply, Request
from tests.test_snapshots import ERASED, PROPS, RESTORED, saved_record
from tests.test_snapshots import reg as reg  # the registry fixture, reused


def _chat(cached: int) -> Reply:
    usage = {
        "prompt_tokens": 1000,
        "completion_tokens": 1,
        "total_tokens": 1001,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return Reply(
        json={
            "choices": [{"index": 0, "finish_reason": "length", "message": {"content": "x"}}],
            "usage": usage,
            "timings": {"cache_n": cached, "prompt_n": 1000 - cached},
        }
    )


def _server(srv: FakeServer, state: dict[str, int], *chats: Reply) -> None:
    def slots(_req: Request) -> Reply:
        task = state["task"]
        return Reply(
            json=[
                {"id": i, "n_ctx": 8192, "is_processing": False, "id_task": task + i}
                for i in (0, 1)
            ]
        )

    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json={**PROPS, "total_slots": 2}))
    srv.route("GET", "/slots", slots)
    srv.route("POST", "/slots/0", lambda req: Reply(json=RESTORED if req.json else ERASED))
    srv.route("POST", "/v1/chat/completions", *chats)


def _run(reg: Registry, srv: FakeServer, state: dict[str, int]) -> KeepAlive:
    with Worker(srv.url) as w:
        keeper = KeepAlive(w, [reg.get("p1")], registry=reg, budget=4, poll_s=0.01)
        first = keeper.step()  # the first warm: a cold prefill
        assert [r.verdict for r in first] == ["cold"]
        state["task"] = 1  # the server restarted: id_task went backwards
        keeper.step()
    return keeper


def test_a_prefix_lost_to_a_restart_comes_back_from_its_snapshot(
    reg: Registry, tmp_path: Path
) -> None:
    sha = reg.resolve("p1")
    state = {"task": 50}
    with FakeServer() as srv:
        _server(srv, state, _chat(0), _chat(990))
        record = saved_record(reg, srv.url, tmp_path / "slots")
        keeper = _run(reg, srv, state)
        posts = [r for r in srv.requests if r.method == "POST"]
        chats = [r.json for r in srv.requests if r.path == "/v1/chat/completions"]
    assert [r.path for r in posts[-3:]] == ["/slots/0", "/slots/0", "/v1/chat/completions"]
    assert [r.json for r in posts[-3:-1]] == [{}, {"filename": record.file}]  # erase, restore
    assert "id_slot" not in chats[0] and chats[1]["id_slot"] == 0  # the check is pinned
    rewarm = keeper.history[-1]
    assert rewarm.verdict == "resumed" and rewarm.snapshot is not None
    snap: dict[str, Any] = dict(rewarm.snapshot)
    assert snap["verdict"] == "restored"
    assert snap["restore_tokens"] == 10 and snap["prefill_tokens"] == 990
    cold_wall = keeper.history[0].record.evidence.wall_s
    assert snap["prefill_s"] == cold_wall and snap["restore_s"] > 0.0042
    s = keeper.summary
    assert (s.restored, s.restore_misses, s.rewarms, s.cold, s.resumed) == (1, 0, 2, 1, 1)
    totals: Any = s.to_dict()["snapshots"]
    assert s.prefill_tokens_avoided == 990 and totals["restored"] == 1
    assert "1 restored from snapshots" in str(s) and "instead of prefilling 990 tokens" in str(s)
    kinds = [m.kind for m in reg.measurements(sha)]
    assert kinds == ["keepalive", "restore", "keepalive"]
    last = reg.measurements(sha)[-1].body
    assert isinstance(last["snapshot"], dict) and last["snapshot"]["verdict"] == "restored"


def test_a_restore_that_does_not_resume_is_followed_by_a_normal_rewarm(
    reg: Registry, tmp_path: Path
) -> None:
    state = {"task": 50}
    with FakeServer() as srv:
        _server(srv, state, _chat(0))  # every call is cold, the restore's check too
        saved_record(reg, srv.url, tmp_path / "slots")
        keeper = _run(reg, srv, state)
        chats = [r.json for r in srv.requests if r.path == "/v1/chat/completions"]
    assert len(chats) == 3 and chats[1]["id_slot"] == 0 and "id_slot" not in chats[2]
    rewarm = keeper.history[-1]
    assert rewarm.verdict == "cold" and rewarm.snapshot is not None
    assert rewarm.snapshot["verdict"] == "not_restored"
    assert (keeper.summary.restored, keeper.summary.restore_misses) == (0, 1)
    assert "1 restores not proven" in str(keeper.summary)


def test_without_a_snapshot_record_a_restart_is_re_warmed_with_no_slot_request(
    reg: Registry,
) -> None:
    state = {"task": 50}
    with FakeServer() as srv:
        _server(srv, state, _chat(0))
        keeper = _run(reg, srv, state)
        slot_posts = [r for r in srv.requests if r.method == "POST" and "/slots" in r.path]
    assert slot_posts == []
    assert keeper.history[-1].snapshot is None and keeper.summary.restored == 0


def test_a_snapshot_that_does_not_verify_is_reported_and_re_warmed(
    reg: Registry, tmp_path: Path
) -> None:
    """The record's directory is gone: nothing is sent to the slot API, the keeper re-warms."""
    state = {"task": 50}
    with FakeServer() as srv:
        _server(srv, state, _chat(0))
        saved_record(reg, srv.url, tmp_path / "slots")
        (tmp_path / "slots").rename(tmp_path / "elsewhere")
        keeper = _run(reg, srv, state)
        slot_posts = [r for r in srv.requests if r.method == "POST" and "/slots" in r.path]
    assert slot_posts == []
    snap = keeper.history[-1].snapshot
    assert snap is not None and snap["verdict"] == "integrity"
    assert "not readable" in str(snap["reason"])
    assert (keeper.summary.restored, keeper.summary.restore_misses) == (0, 1)


def test_a_frame_lost_to_a_restart_comes_back_from_its_snapshot(
    reg: Registry, tmp_path: Path
) -> None:
    tools = '[{"type": "function", "function": {"name": "read_file"}}]'
    frame_sha = reg.add_frame("p1", tools=tools, name="loop")
    state = {"task": 50}
    with FakeServer() as srv:
        _server(srv, state, _chat(0), _chat(990))
        record = saved_record(reg, srv.url, tmp_path / "slots", ref="loop")
        assert record.sha256 == frame_sha
        with Worker(srv.url) as w:
            keeper = KeepAlive(w, [reg.head("loop")], registry=reg, budget=4, poll_s=0.01)
            assert [r.verdict for r in keeper.step()] == ["cold"]
            state["task"] = 1  # a restart
            keeper.step()
        chats = [r.json for r in srv.requests if r.path == "/v1/chat/completions"]
        slot_posts = [r.json for r in srv.requests if r.path == "/slots/0"]
    assert slot_posts == [{}, {"filename": record.file}]  # erase, then restore
    assert chats[1]["tools"] == [{"type": "function", "function": {"name": "read_file"}}]
    rewarm = keeper.history[-1]
    assert rewarm.verdict == "resumed" and dict(rewarm.snapshot or {})["verdict"] == "restored"

"""Frames through keepalive and audit: the whole head kept warm; drift named in a batch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimServer
from prefixreg.verbs.audit.run import run_audit
from prefixreg.verbs.keepalive.run import KeepAlive
from prefixreg.verbs.loop import LoopJudge, LoopVerdict
from prefixreg.verbs.measure.warm import warm
from tests.conftest import run_cli
from tests.test_frames import TURNS, reg, sim, turn  # noqa: F401 -- fixtures
from tests.test_keepalive import Foreign
from tests.test_store import flip_byte


def loop_with_foreign(
    url: str, judge: LoopJudge, keeper: KeepAlive | None, *, every: int = 5
) -> list[LoopVerdict]:
    """`TURNS` loop calls with a growing history, `every` foreign prompts before each."""
    frame = judge.head
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing tests."}]
    verdicts: list[LoopVerdict] = []
    foreign = Foreign(url)
    try:
        with Worker(url) as loop:
            for i in range(TURNS):
                for _ in range(every):
                    foreign.send()
                    if keeper is not None:
                        keeper.step()
                _, ev = loop.chat(frame, history=history, max_tokens=4)
                verdicts.append(judge.observe(ev, frame.body(history))[0])
                if keeper is not None:
                    keeper.touch(frame.sha256)
                    keeper.step()
                turn(history, i)
    finally:
        foreign.close()
    return verdicts


def test_a_kept_frame_keeps_resuming_its_span_under_foreign_traffic(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
) -> None:
    frame = reg.frame("loop")
    with Worker(sim.url) as w:
        assert warm(reg, reg.head("loop"), w).verdict == "resumed"
        judge = LoopJudge.for_worker(reg, frame, w)
    without = loop_with_foreign(sim.url, judge, None)
    assert without.count("resumed") <= 1, without
    with Worker(sim.url, timeout=2.0) as kw:
        keeper = KeepAlive(kw, [frame], registry=reg)
        keeper.step()  # the first re-warm
        judge = LoopJudge.for_worker(reg, frame, kw)
        kept = loop_with_foreign(sim.url, judge, keeper)
    assert kept == ["resumed"] * TURNS, judge.calls
    s = keeper.summary
    assert s.rewarms >= TURNS and s.resumed >= s.rewarms - 1, str(s)
    assert all(r.frame == frame.sha256 for r in keeper.history)
    assert all(r.sha256 == frame.system.sha256 for r in keeper.history)
    rewarms = [m for m in reg.measurements(frame.system.sha256) if m.kind == "keepalive"]
    assert len(rewarms) == s.rewarms
    assert {m.body.get("frame") for m in rewarms} == {frame.sha256}


class Recording(httpx.HTTPTransport):
    """The real transport, keeping each chat body it sends (to check the bytes on the wire)."""

    def __init__(self) -> None:
        super().__init__()
        self.chats: list[bytes] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            self.chats.append(request.read())
        return super().handle_request(request)


def test_keepalive_sends_the_frame_head_byte_for_byte(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
) -> None:
    frame = reg.frame("loop")
    wire = Recording()
    with Worker(sim.url, timeout=2.0, transport=wire) as kw:
        KeepAlive(kw, [frame], registry=reg).step()
    assert len(wire.chats) == 1
    body = json.loads(wire.chats[0])
    assert frame.drift(body) == []
    assert body["tools"] == frame.tools and body["tool_choice"] == "auto"
    assert body["messages"][0] == {"role": "system", "content": frame.system.text}
    assert frame.tools_data is not None
    assert (
        json.dumps(body["tools"], separators=(",", ":")).encode()
        == json.dumps(json.loads(frame.tools_data), separators=(",", ":")).encode()
    )


def test_cli_keepalive_takes_a_frame_and_fails_closed_on_a_tampered_part(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
) -> None:
    root = str(reg.root)
    res = run_cli(
        *("keepalive", "loop", "--worker", sim.url, "--registry", root),
        *("--duration", "0.3", "--poll", "0.05", "--json"),
    )
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout)["rewarms"] >= 1
    frame = reg.frame("loop")
    assert {m.body.get("frame") for m in reg.measurements() if m.kind == "keepalive"} == {
        frame.sha256
    }
    seen = len(sim.requests())
    flip_byte(reg.object_path(frame.tools_sha256 or ""))
    res = run_cli("keepalive", "loop", "--worker", sim.url, "--registry", root, "--duration", "1")
    assert res.returncode == 3, res.stderr
    assert len(sim.requests()) == seen  # nothing sent


def prose_turn(history: list[dict[str, Any]], i: int) -> None:
    """A turn whose tool result reads as a real one (a few lines of test output): the judge's
    byte estimate of the head's span needs the history's bytes to be text, not a one-line
    result that is mostly the template's tokens around it."""
    turn(history, i)
    history[-2]["content"] = f"{i} failed: the store test expected three objects, found four. " * 4


def loop_batch(url: str, reg: Registry, *, flip_at: int) -> list[dict[str, Any]]:  # noqa: F811
    """A warmed loop's request+response pairs as logged; tool_choice "none" from `flip_at`."""
    frame = reg.frame("loop")
    with Worker(url) as w:
        warm(reg, reg.head("loop"), w)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing tests."}]
    pairs: list[dict[str, Any]] = []
    with httpx.Client(base_url=url) as http:
        for i in range(TURNS):
            body = frame.body(history, model="sim", max_tokens=4)
            if i >= flip_at:
                body["tool_choice"] = "none"
            resp = http.post("/v1/chat/completions", json=body)
            resp.raise_for_status()
            pairs.append({"request": body, "response": resp.json(), "wall_s": 0.1})
            prose_turn(history, i)
    return pairs


def test_audit_names_a_tool_choice_flip_mid_loop_with_the_cold_calls(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    frame = reg.frame("loop")
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(
        b"".join(orjson.dumps(p) + b"\n" for p in loop_batch(sim.url, reg, flip_at=3))
    )
    root = str(reg.root)
    res = run_cli("audit", "--frame", "loop", str(batch), "--registry", root, "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)["frame"]
    assert out["frame"] == frame.sha256 and out["name"] == "loop"
    assert (out["requests"], out["in_line"], out["drifted"]) == (TURNS, 3, TURNS - 3)
    assert [[d["part"] for d in c["drift"]] for c in out["calls"]] == [[]] * 3 + [
        ["tool_choice"]
    ] * (TURNS - 3)
    assert [c["cache_state"] for c in out["calls"][:3]] == ["reused"] * 3
    assert out["calls"][3]["cache_state"] == "cold"
    assert "removes the tools" in out["calls"][3]["drift"][0]["detail"]
    (event,) = out["events"]
    assert (event["index"], event["calls"], event["answered"]) == (3, TURNS - 3, TURNS - 3)
    assert event["cold_after"] >= 1
    text = run_cli("audit", "--frame", "loop", str(batch), "--registry", root)
    assert text.returncode == 0, text.stderr
    assert b"3 of 6 requests in line with frame loop" in text.stdout
    assert b'call 3: tool_choice: "auto" -> "none"' in text.stdout
    assert f"{batch}:4: tool_choice [cold]".encode() in text.stdout


def test_audit_counts_a_shared_frame_by_the_requests_that_send_it_whole(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    # Every request sends the frame's system prompt; only the first four send the frame.
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(
        b"".join(orjson.dumps(p) + b"\n" for p in loop_batch(sim.url, reg, flip_at=4))
    )
    args = ("audit", "--frame", "loop", str(batch), "--registry", str(reg.root))
    out = orjson.loads(run_cli(*args, "--json").stdout)
    shared = out["shared_prefix"]
    assert shared["frame"] == reg.frame("loop").sha256 and shared["method"] == "identity"
    assert (shared["support"], shared["of"], out["frame"]["in_line"]) == (4, TURNS, 4)
    assert f"byte identity: 4 of {TURNS} requests send it" in run_cli(*args).stdout.decode()


def test_audit_names_changed_tools_and_a_dropped_setting_in_bare_request_bodies(
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    frame = reg.frame("loop")
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    same = frame.body(history, model="m")
    fewer = frame.body(history, model="m") | {"tools": (frame.tools or [])[:2]}
    dropped = frame.body(history, model="m")
    del dropped["chat_template_kwargs"]
    batch = tmp_path / "requests.jsonl"
    batch.write_bytes(b"".join(orjson.dumps(b) + b"\n" for b in (same, fewer, fewer, dropped)))
    res = run_cli(
        *("audit", "--frame", frame.sha256[:12], str(batch), "--registry", str(reg.root)),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)["frame"]
    parts = [[d["part"] for d in c["drift"]] for c in out["calls"]]
    assert parts == [[], ["tools"], ["tools"], ["chat_template_kwargs"]]
    assert out["calls"][1]["drift"][0]["detail"].startswith("changed")
    assert out["calls"][3]["drift"][0]["detail"].startswith("dropped")
    assert [(e["index"], e["calls"], e["answered"]) for e in out["events"]] == [
        (1, 2, 0),
        (3, 1, 0),
    ]
    # No response beside the bodies: nothing is claimed about cold calls.
    assert all(c["cache_state"] is None for c in out["calls"])


def test_audit_frame_fails_closed_on_a_tampered_part(
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    frame = reg.frame("loop")
    batch = tmp_path / "requests.jsonl"
    batch.write_bytes(orjson.dumps(frame.body([{"role": "user", "content": "go"}])) + b"\n")
    flip_byte(reg.object_path(frame.tools_sha256 or ""))
    res = run_cli("audit", "--frame", "loop", str(batch), "--registry", str(reg.root))
    assert res.returncode == 3, res.stderr
    assert res.stdout == b""
    missing = run_cli("audit", "--frame", "nope", str(batch), "--registry", str(reg.root))
    assert missing.returncode == 2, missing.stderr


def test_audit_judges_each_in_line_call_against_the_frame_and_names_it(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    frame = reg.head("loop")
    assert isinstance(frame, Frame)
    batch = tmp_path / "batch.jsonl"
    pairs = loop_batch(sim.url, reg, flip_at=TURNS)  # every call in line with the frame
    batch.write_bytes(b"".join(orjson.dumps(p) + b"\n" for p in pairs))
    report = run_audit([batch], registry=reg, frame=frame)
    assert report.prefix is not None
    assert (report.prefix.frame, report.prefix.method) == (frame.sha256, "identity")
    assert report.prefix.label().startswith("frame loop (")
    assert all(c.frame == frame.sha256 and c.head_bytes == frame.head_bytes for c in report.calls)
    assert report.states() == {"reused": TURNS, "partial": 0, "cold": 0, "unverified": 0}
    # The library takes the verified head, never a reference.
    with pytest.raises(UsageError):
        run_audit([batch], registry=reg, frame="loop")  # type: ignore[arg-type]
    # Whatever works for a frame works for a prefix: its head is the system bytes alone.
    res = run_cli(
        *("audit", "--frame", frame.system.sha256, str(batch), "--registry", str(reg.root)),
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert (out["frame"]["frame"], out["frame"]["in_line"]) == (frame.system.sha256, TURNS)
    assert out["shared_prefix"]["sha256"] == frame.system.sha256


def test_audit_frame_lists_a_head_it_cannot_compare_as_malformed(
    reg: Registry,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Issue 22: content parts whose text is an int or null, tools 1,000 deep."""
    frame = reg.head("loop")
    assert isinstance(frame, Frame)
    good = frame.body([{"role": "user", "content": "go"}], model="m")
    lines = [orjson.dumps(good)]
    for text in (5, None):
        body = dict(good)
        body["messages"] = [{"role": "system", "content": [{"type": "text", "text": text}]}]
        lines.append(orjson.dumps({"request": body, "response": {"choices": []}}))
    deep = b"[" * 1000 + b"]" * 1000
    lines.append(b'{"messages": [{"role": "system", "content": "s"}], "tools": ' + deep + b"}")
    batch = tmp_path / "hostile.jsonl"
    batch.write_bytes(b"\n".join(lines) + b"\n")
    res = run_cli("audit", "--frame", "loop", str(batch), "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    reasons = {m["source"]: m["reason"] for m in out["malformed"]}
    assert reasons[f"{batch}:2"] == "messages[0].content[0].text is not a string"
    assert reasons[f"{batch}:3"] == "messages[0].content[0].text is not a string"
    assert "nested deeper than 64 levels" in reasons[f"{batch}:4"]
    assert out["frame"]["requests"] == 1 and out["frame"]["in_line"] == 1
    assert out["calls"] == 2  # the paired responses still count (unverified: no usage)


def test_loop_judge_takes_the_span_the_server_counted_and_the_tools_rule(
    sim: SimServer,  # noqa: F811
    reg: Registry,  # noqa: F811
) -> None:
    frame = reg.frame("loop")
    history = [{"role": "user", "content": "Fix the failing tests."}]
    with Worker(sim.url) as w:
        judge = LoopJudge.for_worker(reg, frame, w)
        assert judge.span is None  # nothing resumed here yet: no measured span
        result = warm(reg, frame, w)
        assert result.verdict == "resumed"
        judge = LoopJudge.for_worker(reg, frame, w)
        assert judge.span == result.calls[-1].evidence.cached_tokens  # the server's count
        _, ev = w.chat(frame, history=history, max_tokens=4)
    assert judge.observe(ev, frame.body(history))[0] == "resumed"
    # Without its request body nothing shows the call sent the frame (issue 33: it said
    # resumed): unverified, and why, whatever the counts cover.
    verdict, why = judge.observe(ev)
    assert verdict == "unverified" and "no request body to check" in why, why
    assert "resumed" in why  # what the counts alone say is kept in the reason
    # A frame whose tools the server's template drops is never resumed for its tools.
    dropped = LoopJudge(frame, judge.build_id, 0, judge.baseline, judge.span, tools_tokens=0)
    verdict, why = dropped.observe(ev, frame.body(history))
    assert verdict == "unverified" and "tools add no prompt tokens" in why
    # A last warm that did not resume measured nothing: a loop call is judged by its bytes.
    unmeasured = LoopJudge(frame, judge.build_id, 0, judge.baseline)
    assert unmeasured.observe(ev)[0] == "unverified"
    assert unmeasured.observe(ev, frame.body(history))[0] == "resumed"

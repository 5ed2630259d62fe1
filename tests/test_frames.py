"""Frames: the loop's real request head (system, tools, prompt settings), end to end on the sim."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from prefixreg.core.errors import IntegrityError, UsageError
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.audit.identity import drift_events
from prefixreg.verbs.loop import LoopJudge
from prefixreg.verbs.measure.warm import warm
from tests.conftest import run_cli
from tests.test_store import flip_byte

SYSTEM = "You are a careful coding agent. Follow the repository's conventions.\n" * 40
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in the working tree. " * 6,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for name in ("read_file", "write_file", "run_tests", "grep")
]
SETTINGS = {"tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False}}
TURNS = 6


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(speed=2000)) as server:
        yield server


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="system")
    reg.add_frame("system", tools=json.dumps(TOOLS, indent=1), settings=SETTINGS, name="loop")
    return reg


def turn(history: list[dict[str, Any]], i: int) -> None:
    """One turn of a coding loop: the assistant calls a tool, the tool answers, the user goes on."""
    call_id = f"call_{i}"
    history.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "run_tests", "arguments": json.dumps({"path": f"t{i}"})},
                }
            ],
        }
    )
    history.append({"role": "tool", "tool_call_id": call_id, "content": f"{i} failed. " * 5})
    history.append({"role": "user", "content": f"Step {i}: fix the first failure."})


def run_loop(
    worker: Worker, judge: LoopJudge, *, flip_at: int | None = None
) -> list[tuple[dict[str, Any], str, str]]:
    """`TURNS` calls with a growing history; from `flip_at` on tool_choice is "none"."""
    frame = judge.head
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing tests."}]
    out: list[tuple[dict[str, Any], str, str]] = []
    for i in range(TURNS):
        if flip_at is not None and i >= flip_at:
            body = frame.body(history) | {"tool_choice": "none"}
            _, ev = worker.chat(
                frame.system,
                history=history,
                tools=body["tools"],
                tool_choice="none",
                chat_template_kwargs=body["chat_template_kwargs"],
                max_tokens=4,
            )
        else:
            body = frame.body(history)
            _, ev = worker.chat(frame, history=history, max_tokens=4)
        verdict, _ = judge.observe(ev, body)
        out.append((body, ev.cache_state, verdict))
        turn(history, i)
    return out


def test_frame_record_is_canonical_and_named_by_its_own_bytes(reg: Registry) -> None:
    frame = reg.frame("loop")
    raw = (reg.root / "frames" / f"{frame.sha256}.json").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == frame.sha256
    record = json.loads(raw)
    assert record == {
        "format": "prefix-frame",
        "version": 1,
        "system": reg.resolve("system"),
        "tools": frame.tools_sha256,
        "settings": SETTINGS,
    }
    assert reg.read_verified(frame.tools_sha256 or "") == json.dumps(TOOLS, indent=1).encode()
    assert frame.tools == TOOLS and frame.settings == SETTINGS
    # Idempotent, named like a prefix, and `verify` knows the frames directory.
    again = reg.add_frame("system", tools=json.dumps(TOOLS, indent=1), settings=SETTINGS)
    assert again == frame.sha256 and reg.read_name("loop") == frame.sha256
    assert verify_registry(reg).ok
    with pytest.raises(UsageError, match="not a prompt setting"):
        reg.add_frame("system", settings={"temperature": 0})


def test_body_puts_verified_head_before_history_and_refuses_a_conflicting_part(
    reg: Registry,
) -> None:
    frame = reg.frame("loop")
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    turn(history, 0)
    body = frame.body(history, model="m", max_tokens=8)
    assert body["messages"][0] == {"role": "system", "content": SYSTEM}
    assert body["messages"][1:] == history
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto"
    assert frame.drift(body) == []
    with pytest.raises(UsageError, match="tool_choice"):
        frame.body(history, tool_choice="none")
    kwargs = frame.openai_kwargs(history, model="m")
    assert kwargs["extra_body"] == {"chat_template_kwargs": {"enable_thinking": False}}
    assert kwargs["tools"] == TOOLS and kwargs["tool_choice"] == "auto"


def test_loop_with_tools_resumes_the_frame_span_on_every_call(
    sim: SimServer, reg: Registry
) -> None:
    with Worker(sim.url) as w:
        result = warm(reg, reg.head("loop"), w)
        assert result.verdict == "resumed"
        assert result.measurement.body["frame"] == reg.read_name("loop")
        judge = LoopJudge.for_worker(reg, reg.frame("loop"), w)
        span = judge.span
        assert span is not None and span > 0
        calls = run_loop(w, judge)
    assert [v for _, _, v in calls] == ["resumed"] * TURNS
    # The tools are in the warmed span: without them the head would be far shorter.
    assert span > len(SYSTEM) // 4


def test_bare_system_warm_is_a_frame_mismatch_never_resumed(sim: SimServer, reg: Registry) -> None:
    with Worker(sim.url) as w:
        assert warm(reg, reg.head("system"), w).verdict == "resumed"
        judge = LoopJudge.for_worker(reg, reg.frame("loop"), w)
        calls = run_loop(w, judge)
    assert [v for _, _, v in calls] == ["head-mismatch"] * TURNS
    assert calls[0][1] == "cold"  # the tools changed the prefix: the warm bought nothing
    assert "bare system prompt" in judge.calls[0][1]


def test_tool_choice_flip_mid_loop_is_named_as_drift_with_the_cold_calls(
    sim: SimServer, reg: Registry
) -> None:
    with Worker(sim.url) as w:
        warm(reg, reg.head("loop"), w)
        judge = LoopJudge.for_worker(reg, reg.frame("loop"), w)
        calls = run_loop(w, judge, flip_at=3)
    assert [v for _, _, v in calls] == ["resumed"] * 3 + ["drift"] * 3
    assert "tool_choice" in judge.calls[3][1] and "removes the tools" in judge.calls[3][1]
    frame = reg.frame("loop")
    events = drift_events([(tuple(frame.drift(b)), s) for b, s, _ in calls])
    assert len(events) == 1
    event = events[0]
    assert event.index == 3 and [d.part for d in event.drift] == ["tool_choice"]
    assert calls[3][1] == "cold" and event.cold_after >= 1 and event.calls == 3
    assert "tool_choice" in str(event)


def test_tampered_tools_object_fails_closed_and_sends_nothing(
    sim: SimServer, reg: Registry
) -> None:
    frame = reg.frame("loop")
    flip_byte(reg.object_path(frame.tools_sha256 or ""))
    with pytest.raises(IntegrityError):
        reg.frame("loop")
    res = run_cli("warm", "loop", "--worker", sim.url, "--registry", str(reg.root))
    assert res.returncode == 3, res.stderr
    assert res.stdout == b""
    assert sim.requests() == []  # not even /health
    assert not verify_registry(reg).ok


def test_tampered_frame_record_fails_closed(sim: SimServer, reg: Registry) -> None:
    sha = reg.read_name("loop") or ""
    flip_byte(reg.root / "frames" / f"{sha}.json")
    res = run_cli("warm", "loop", "--worker", sim.url, "--registry", str(reg.root))
    assert res.returncode == 3 and sim.requests() == []


def test_check_only_says_whether_the_frame_or_the_server_lost_it(
    sim: SimServer, reg: Registry
) -> None:
    root = str(reg.root)
    with Worker(sim.url) as w:
        warm(reg, reg.head("system"), w)  # the bare system prompt only
    # (The check itself leaves the frame's head in the cache: one check per state here.)
    cli = run_cli("warm", "loop", "--check-only", "--worker", sim.url, "--registry", root)
    assert cli.returncode == 1 and b"the frame lost it" in cli.stdout
    assert run_cli("warm", "loop", "--worker", sim.url, "--registry", root).returncode == 0
    with Worker(sim.url) as w:
        for i in range(9):  # more than the 8-entry LRU holds
            w.chat(f"Foreign system prompt number {i}, unrelated. " * 30, "hello")
    cli = run_cli("warm", "loop", "--check-only", "--worker", sim.url, "--registry", root)
    assert cli.returncode == 1 and b"the server lost it" in cli.stdout, cli.stdout
    with Worker(sim.url) as w:
        res = warm(reg, reg.head("loop"), w)
        assert res.diagnosis == ""  # a warm (not --check-only) needs no diagnosis
        res = warm(reg, reg.head("loop"), w, send_warm=False)
    assert res.diagnosis.startswith("the server holds this frame")


def test_openai_sdk_sends_the_api_body_unchanged(sim: SimServer, reg: Registry) -> None:
    import openai  # a dev dependency: a missing one fails here, never skips

    sent: list[bytes] = []

    def capture(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(request.read())

    frame = reg.frame("loop")
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing tests."}]
    turn(history, 0)
    with Worker(sim.url) as w:
        warm(reg, reg.head("loop"), w)
        judge = LoopJudge.for_worker(reg, frame, w)
    with httpx.Client(event_hooks={"request": [capture]}) as http:
        # The SDK types its client against its own httpx fork; an httpx.Client works alike.
        client = openai.OpenAI(
            base_url=f"{sim.url}/v1", api_key="unused", http_client=cast(Any, http)
        )
        resp = client.chat.completions.create(
            **frame.openai_kwargs(history, model="sim", max_tokens=4)
        )
    assert len(sent) == 1
    assert json.loads(sent[0]) == frame.body(history, model="sim", max_tokens=4)
    ev = evidence_from_response(resp)
    assert judge.observe(ev, json.loads(sent[0]))[0] == "resumed"


def test_sim_renders_tools_into_the_system_part(sim: SimServer, reg: Registry) -> None:
    frame = reg.frame("loop")
    with Worker(sim.url) as w:
        _, bare = w.chat(frame.system, "hi", max_tokens=1)
        _, tooled = w.chat(frame.system, "hi", tools=TOOLS, max_tokens=1)
        _, none = w.chat(frame.system, "hi", tools=TOOLS, tool_choice="none", max_tokens=1)
        with pytest.raises(UsageError, match="exactly one"):
            w.chat(frame.system, "hi", history=[])
    assert (tooled.prompt_tokens or 0) > (bare.prompt_tokens or 0) + 100
    assert none.prompt_tokens == bare.prompt_tokens


def test_tools_and_settings_that_cannot_travel_byte_for_byte_are_usage_errors(
    reg: Registry, tmp_path: Path
) -> None:
    nan = tmp_path / "nan.json"
    nan.write_text('[{"type": "function", "x": NaN}]')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for bad in (nan, deep):
        res = run_cli("frame", "system", "--tools", str(bad), "--registry", str(reg.root))
        assert res.returncode == 2, res.stderr
        assert res.stderr.startswith(b"error: tools:") and b"Traceback" not in res.stderr


@pytest.mark.parametrize("depth", [60, 62, 63, 200])
def test_settings_nested_at_or_past_the_depth_limit_are_usage_errors(
    reg: Registry, depth: int
) -> None:
    """Settings that nest at the limit (inside the record: two levels more) are refused
    like any settings that do not parse, never with a bare ValueError."""
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    if depth < 62:
        assert reg.add_frame("system", settings={"chat_template_kwargs": nested}, name="deep")
        return
    with pytest.raises(UsageError, match="settings are not JSON: nested deeper than 64"):
        reg.add_frame("system", settings={"chat_template_kwargs": nested}, name="deep")


def test_gc_refuses_to_guess_the_parts_of_a_frame_record_it_cannot_read(reg: Registry) -> None:
    from prefixreg.registry.gc import collect_garbage

    frame = reg.frame("loop")
    record = reg.root / "frames" / f"{frame.sha256}.json"
    record.chmod(0o644)
    record.write_bytes(b"{broken")
    with pytest.raises(IntegrityError, match="cannot tell which objects"):
        collect_garbage(reg, grace_s=0, prune_unnamed=True, now=time.time() + 90 * 86400)
    assert reg.read_verified(frame.tools_sha256 or "")  # the unnamed tools object survives


def test_a_setting_of_the_wrong_json_type_is_refused_for_a_new_frame(
    tmp_path: Path, reg: Registry
) -> None:
    """`--set enable_thinking=False` would store the string "False", which a template reads
    as true: a new frame's settings take each one's JSON type; a stored frame reads as is."""
    root = str(reg.root)
    for pair in ("enable_thinking=False", "parallel_tool_calls=maybe", "reasoning_effort=3"):
        res = run_cli("frame", "system", "--set", pair, "--registry", root)
        assert res.returncode == 2 and b"must be" in res.stderr, (pair, res.stderr)
        assert b"Traceback" not in res.stderr
    for pair in ("enable_thinking=false", "tool_choice=auto", 'tool_choice={"type": "none"}'):
        assert run_cli("frame", "system", "--set", pair, "--registry", root).returncode == 0, pair
    with pytest.raises(UsageError, match="enable_thinking must be true or false"):
        reg.add_frame("system", settings={"enable_thinking": "False"})
    # A frame stored before the rule (its record carries a string) still reads as it was.
    from prefixreg.core.frame import encode_frame_record, parse_frame_record

    raw = encode_frame_record(
        reg.get("system").sha256, None, {"enable_thinking": "no"}, typed=False
    )
    sha = hashlib.sha256(raw).hexdigest()
    assert parse_frame_record(sha, raw)[2] == {"enable_thinking": "no"}


def test_verify_reports_what_is_not_a_frame_record_in_frames_as_meta_does(reg: Registry) -> None:
    frames = reg.root / "frames"
    (frames / "junk").write_bytes(b"hi\n")
    (frames / "x.json").write_bytes(b"{")  # a record's suffix, not a sha: not a frame record
    (frames / f"{'ab' * 32}.json").mkdir()  # a frame's name, not a file
    (reg.root / "meta" / "junk").write_bytes(b"hi\n")
    found = {(f.kind, f.path, f.severity) for f in verify_registry(reg).findings}
    assert found == {
        ("unexpected", "frames/junk", "problem"),
        ("unexpected", "frames/x.json", "problem"),
        ("unexpected", f"frames/{'ab' * 32}.json", "problem"),
        ("unexpected", "meta/junk", "problem"),
    }
    (reg.root / "meta" / "junk").unlink()
    result = run_cli("verify", "--registry", str(reg.root))
    assert result.returncode == 1
    assert b"unexpected   frames/junk: not a frame record" in result.stdout


def test_a_name_of_the_other_kind_is_refused_before_anything_is_written(
    reg: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixreg.registry.names import NameConflictError, Names
    from tests.test_store import tree

    before = tree(reg.root)
    with pytest.raises(NameConflictError, match="points to frame"):
        reg.add("a new prefix\n", name="loop")  # `loop` holds a frame
    with pytest.raises(NameConflictError, match="points to prefix"):
        reg.add_frame("system", tools='[{"type": "x"}]', name="system")
    assert tree(reg.root) == before  # neither the object, the tools nor the record
    # The early look is only for the refusal: the move still decides under the lock (a name
    # moved between the look and the move is refused there).
    monkeypatch.setattr(Names, "precheck", lambda *_a, **_k: None)
    with pytest.raises(NameConflictError, match="points to frame"):
        reg.add("a new prefix\n", name="loop")
    assert reg.read_name("loop") == reg.frame("loop").sha256
    monkeypatch.undo()
    sha = reg.add("a new prefix\n", name="loop", force=True)
    assert reg.read_name("loop") == sha

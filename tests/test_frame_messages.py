"""A frame's leading messages: the messages a loop sends after its system message on every
call (few-shot examples, a static first user message) registered as a part of the head. The
record and sha of a frame without them are what they always were; with them the parts are
verified at use, kept by gc, sent by `messages()`, named in drift, and a gateway names the
head of a request that starts with them as that frame, their bytes in the head's span."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from prefixreg.core.digest import sha256_hex
from prefixreg.core.errors import CorruptRecordError, IntegrityError, UsageError
from prefixreg.core.frame import encode_frame_record, parse_frame_record
from prefixreg.core.prefix import text_bytes
from prefixreg.gateway.config import GatewayConfig
from prefixreg.gateway.serve import serve_in_thread
from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.store import Registry
from prefixreg.sim import SimServer
from tests.conftest import run_cli

SYSTEM = "You are a coding agent. Follow the repository's rules and keep each diff small. " * 20
LEAD = [
    {"role": "user", "content": "Fixed instructions: read the issue, then the code, then act."},
    {"role": "assistant", "content": "Understood: issue, code, then one change at a time."},
]


def test_a_frame_without_messages_keeps_its_record_and_one_with_them_names_them() -> None:
    system, lead = "a" * 64, "b" * 64
    plain = encode_frame_record(system, None, {})
    assert plain == encode_frame_record(system, None, {}, messages=None)
    assert b"messages" not in plain
    with_lead = encode_frame_record(system, None, {}, messages=lead)
    assert json.loads(with_lead)["messages"] == lead
    assert parse_frame_record(sha256_hex(with_lead), with_lead)[3] == lead
    assert parse_frame_record(sha256_hex(plain), plain)[3] is None
    with pytest.raises(UsageError):
        encode_frame_record(system, None, {}, messages="not a sha")
    odd = plain.replace(b'"settings"', b'"messages":7,"settings"')
    with pytest.raises(CorruptRecordError):
        parse_frame_record(sha256_hex(odd), odd)


def test_a_frame_with_leading_messages_sends_them_and_names_their_drift(
    registry: Registry,
) -> None:
    system = registry.add(SYSTEM)
    sha = registry.add_frame(system, messages=json.dumps(LEAD, indent=2), name="agent")
    frame = registry.frame("agent")
    assert frame.sha256 == sha and frame.lead == LEAD
    history = [{"role": "user", "content": "now fix the bug"}]
    assert frame.messages(history) == [{"role": "system", "content": SYSTEM}, *LEAD, *history]
    assert frame.head_bytes == len(SYSTEM.encode()) + text_bytes(LEAD)
    assert frame.drift(frame.body(history, model="m")) == []
    changed = [LEAD[0], {"role": "assistant", "content": "Something else."}]
    sent = {"messages": [{"role": "system", "content": SYSTEM}, *changed, *history]}
    assert [d.part for d in frame.drift(sent)] == ["messages"]
    assert registry.add_frame(system, name="plain") != sha  # without them: another frame


@pytest.mark.parametrize(
    "bad",
    [
        b"[]",
        b'{"role": "user"}',
        b'[{"content": "no role"}]',
        b'[{"role": "system", "content": "x"}]',
    ],
)
def test_leading_messages_that_are_not_a_list_of_messages_are_refused(
    registry: Registry, bad: bytes
) -> None:
    system = registry.add(SYSTEM)
    with pytest.raises(UsageError):
        registry.add_frame(system, messages=bad)
    assert registry.list_objects(frames=True) == [
        o for o in registry.list_objects(frames=True) if o.kind == "prefix"
    ]


def test_a_tampered_messages_object_fails_closed_and_gc_keeps_a_named_frames(
    registry: Registry,
) -> None:
    system = registry.add(SYSTEM)
    registry.add_frame(system, messages=json.dumps(LEAD), name="agent")
    lead_sha = sha256_hex(json.dumps(LEAD).encode())
    kinds = {o.sha256: o.kind for o in registry.list_objects()}
    assert kinds[lead_sha] == "messages"
    report = collect_garbage(registry, grace_s=0, prune_unnamed=True)
    assert lead_sha in report.kept
    path = registry.object_path(lead_sha)
    os.chmod(path, 0o644)
    path.write_text(json.dumps([{"role": "user", "content": "other"}]))
    with pytest.raises(IntegrityError):
        registry.frame("agent")
    done = run_cli("verify", "--registry", str(registry.root))
    assert done.returncode == 1 and lead_sha.encode() in done.stdout, done.stdout


def test_frame_messages_on_the_command_line(registry: Registry, tmp_path: Path) -> None:
    system = registry.add(SYSTEM)
    lead = tmp_path / "lead.json"
    lead.write_text(json.dumps(LEAD))
    done = run_cli("frame", system, "--messages", str(lead), "--name", "agent",
                   "--registry", str(registry.root))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().strip() == registry.resolve("agent")
    shown = run_cli("cat", "agent", "--registry", str(registry.root))
    assert json.loads(shown.stdout)["messages"] == LEAD
    lead.write_text('[{"role": "system", "content": "the frame has its own"}]')
    bad = run_cli("frame", system, "--messages", str(lead), "--registry", str(registry.root))
    assert bad.returncode == 2 and b"system message" in bad.stderr
    assert b"Traceback" not in bad.stderr


def test_the_gateway_names_a_request_that_starts_with_a_frames_leading_messages(
    sim: SimServer, registry: Registry
) -> None:
    system = registry.add(SYSTEM)
    sha = registry.add_frame(system, messages=json.dumps(LEAD), name="agent")
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root)
    sys_msg = {"role": "system", "content": SYSTEM}
    task = {"role": "user", "content": "now fix the bug"}
    with serve_in_thread(config) as (url, _), httpx.Client(base_url=url) as client:
        body = {"model": "m", "max_tokens": 4, "messages": [sys_msg, *LEAD, task]}
        first = client.post("/v1/chat/completions", json=body)
        again = client.post("/v1/chat/completions", json=body)
        other = dict(body, messages=[sys_msg, task])
        plain = client.post("/v1/chat/completions", json=other)
        calls = [client.get(f"/prefixreg/calls/{r.headers['x-prefixreg-call']}").json()
                 for r in (again, plain)]  # fmt: skip
    assert first.headers["x-prefixreg-head"] == sha
    assert first.headers["x-prefixreg-head-name"] == "agent"
    assert plain.headers["x-prefixreg-head"] == system  # without them: the bare prefix
    assert again.headers["x-prefixreg-verdict"] == "resumed"
    # The leading messages are in the head's span: the judge's span counts them.
    framed, bare = (c["gateway"]["judgement"]["span_tokens"] for c in calls)
    assert framed > bare > 0, calls


def test_a_session_whose_leading_messages_change_is_told_the_part(
    sim: SimServer, registry: Registry
) -> None:
    system = registry.add(SYSTEM)
    registry.add_frame(system, messages=json.dumps(LEAD), name="agent")
    config = GatewayConfig(workers=(sim.url,), registry_root=registry.root)
    sys_msg, task = {"role": "system", "content": SYSTEM}, {"role": "user", "content": "go"}
    changed = [LEAD[0], {"role": "assistant", "content": "A reply that differs."}]
    with serve_in_thread(config) as (url, _), httpx.Client(base_url=url) as client:
        key = {"model": "m", "max_tokens": 4, "prompt_cache_key": "loop-1"}
        client.post("/v1/chat/completions", json=key | {"messages": [sys_msg, *LEAD, task]})
        later = client.post(
            "/v1/chat/completions", json=key | {"messages": [sys_msg, *changed, task]}
        )
    assert later.headers["x-prefixreg-drift"] == "messages"

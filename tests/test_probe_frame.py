"""`prefixreg probe --frame`: each size's prefix with the frame's tools and settings, on the sim.

The simulator renders tools into the prompt (their tokens count in the system part), so a
frame's head is longer than its bare slice, and legs judged against the slice alone would
claim less than was resumed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.frame import Frame
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.options import ProbeOptions
from prefixreg.verbs.probe.run import check_sizes, run_probe
from tests.conftest import run_cli
from tests.test_store import flip_byte

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in the working tree. " * 20,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for name in ("read_file", "write_file", "run_tests", "grep")
]
SETTINGS = {"tool_choice": "auto"}


def loop_frame(reg: Registry) -> Frame:
    frame = reg.head("loop")
    assert isinstance(frame, Frame)
    return frame


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    reg = Registry(tmp_path / "reg")
    reg.add("You are a coding agent.\n" * 10, name="system")
    reg.add_frame("system", tools=json.dumps(TOOLS), settings=SETTINGS, name="loop")
    return reg


def test_probe_with_a_frame_sends_its_head_and_records_its_sha(
    sim: SimServer, reg: Registry
) -> None:
    frame = loop_frame(reg)
    with Worker(sim.url) as w:
        bare = run_probe(reg, w, ProbeOptions(sizes=(4000,), foreign=2))
        framed = run_probe(reg, w, ProbeOptions(sizes=(4000,), foreign=2, frame=frame))
    by_leg = {c.leg: c for c in framed.calls if c.leg in ("A1", "B", "C")}
    bare_b = next(c for c in bare.calls if c.leg == "B")
    # The tools reached the prompt: the same size's B prompt is longer by their tokens.
    framed_prompt = by_leg["B"].record.evidence.prompt_tokens or 0
    assert framed_prompt > (bare_b.record.evidence.prompt_tokens or 0) + 200
    # Judged against the whole head: the span counts the tools too, and B resumes it.
    assert by_leg["B"].verdict == "resumed"
    framed_j, bare_j = by_leg["B"].judgement, bare_b.judgement
    assert framed_j is not None and bare_j is not None
    assert (framed_j.span or 0) > (bare_j.span or 0) + 200
    assert (framed_j.coverage or 0) >= 0.9
    mine = [m for m in reg.measurements() if m.body.get("probe") == framed.run_id]
    assert len(mine) == 4 and {m.body.get("frame") for m in mine} == {frame.sha256}
    theirs = [m for m in reg.measurements() if m.body.get("probe") == bare.run_id]
    assert theirs and all("frame" not in m.body for m in theirs)
    assert framed.json_path is not None and framed.md_path is not None
    receipt = orjson.loads(Path(framed.json_path).read_bytes())
    assert receipt["options"]["frame"] == frame.sha256
    assert frame.sha256[:16] in Path(framed.md_path).read_text()


def test_probe_counts_the_frames_tools_toward_the_context(reg: Registry) -> None:
    frame = loop_frame(reg)
    tools = len(frame.tools_data or b"")
    # A context of 1,000 tokens holds at most ~8,000 characters: the size fits alone, not
    # with the tools on top.
    with SimServer(SimConfig(speed=5000, slot_ctx=1000)) as small, Worker(small.url) as w:
        size = 8000 - tools // 2
        check_sizes(ProbeOptions(sizes=(size,), foreign_chars=100), w.server_build())
        with pytest.raises(UsageError, match="bytes of tools"):
            run_probe(reg, w, ProbeOptions(sizes=(size,), foreign=1, frame=frame))
        assert all(r.path != "/v1/chat/completions" for r in small.requests())


def test_cli_probe_frame_json_and_a_tampered_frame_sends_nothing(
    sim: SimServer, reg: Registry
) -> None:
    root = str(reg.root)
    res = run_cli(
        *("probe", "--worker", sim.url, "--sizes", "4k", "--foreign", "2", "--frame", "loop"),
        *("--registry", root, "--json"),
    )
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout)["options"]["frame"] == reg.read_name("loop")
    frame = loop_frame(reg)
    flip_byte(reg.object_path(frame.tools_sha256 or ""))
    seen = len(sim.requests())
    bad = run_cli(
        *("probe", "--worker", sim.url, "--sizes", "4k", "--frame", "loop"),
        *("--registry", root, "--json"),
    )
    assert bad.returncode == 3, bad.stderr
    assert bad.stdout == b"" and len(sim.requests()) == seen


def test_probe_frame_takes_a_frame_object_and_refuses_a_prefix(
    sim: SimServer, reg: Registry
) -> None:
    # The library takes the verified head, never a reference to resolve again.
    with pytest.raises(UsageError, match="Frame"):
        ProbeOptions(sizes=(4000,), frame="loop")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="Frame"):
        ProbeOptions(sizes=(4000,), frame=reg.head("system"))  # type: ignore[arg-type]
    res = run_cli(
        *("probe", "--worker", sim.url, "--sizes", "4k", "--frame", "system"),
        *("--registry", str(reg.root), "--json"),
    )
    assert res.returncode == 2 and b"names a prefix, not a frame" in res.stderr
    assert res.stdout == b"" and sim.requests() == []

"""`prefixreg audit` over requests: byte identity of the system prefix, drift, and inputs
that must never hang or be followed (FIFOs, symlinks).

The batch is written here as request+response JSON lines; the expected shas are computed
here with hashlib from the same strings, not by the code under test.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from prefixreg.registry.store import Registry
from prefixreg.verbs.audit.identity import system_prompt
from prefixreg.verbs.audit.read import MAX_DOCUMENT, AuditInput, read_outputs
from prefixreg.verbs.audit.report import PrefixSpan
from prefixreg.verbs.audit.run import Known, audit_calls
from tests.test_audit import Row, _call, response

SYSTEM = "You are a careful coding agent. Ünïcode kept byte for byte.\n" * 50
OTHER = "You are a terse reviewer.\n" * 40


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def request(system: Any, tail: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": tail}],
    }


def audit(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "prefixreg", "audit", *args],
        capture_output=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path / "reg")
    r.add(SYSTEM, name="coding-loop")
    r.add(OTHER, name="reviewer")
    return r


def write_pairs(path: Path) -> dict[str, str]:
    """Seven pairs: 4 on SYSTEM, one with a trailing space (unregistered drift), one on
    OTHER (registered drift), one whose first message is content parts. Returns
    source -> expected status."""
    systems: list[Any] = [SYSTEM, SYSTEM, SYSTEM + " ", SYSTEM, OTHER, [{"type": "text"}], SYSTEM]
    status = ["identical", "identical", "drifted", "identical", "drifted", "no_text", "identical"]
    lines = []
    for i, system in enumerate(systems):
        pair = {
            "request": request(system, f"question {i}"),
            "response": response(Row(900, 800 if i else 0, 40)),
            "wall_s": 1.5,
        }
        lines.append(orjson.dumps(pair))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return {f"{path}:{i + 1}": s for i, s in enumerate(status)}


def test_pairs_name_the_registered_prefix_by_sha_and_list_drift(
    tmp_path: Path, reg: Registry
) -> None:
    batch = tmp_path / "calls.jsonl"
    want = write_pairs(batch)
    res = audit("--registry", str(reg.root), "--json", str(batch))
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == 7  # every response is still accounted for
    ident = out["system_prefix"]
    assert ident["batch_prefix"] == {
        "sha256": sha(SYSTEM),
        "bytes": len(SYSTEM.encode()),
        "names": ["coding-loop"],
        "registered": True,
        "probe_slice": False,
    }
    assert ident["identical"] == 4
    drifted = [s for s, st in want.items() if st == "drifted"]
    assert ident["drifted"] == drifted
    assert ident["no_text"] == [s for s, st in want.items() if st == "no_text"]
    per_call = {c["source"]: c for c in ident["calls"]}
    assert {s: c["status"] for s, c in per_call.items()} == want
    assert per_call[drifted[0]]["sha256"] == sha(SYSTEM + " ")
    assert per_call[drifted[0]]["registered"] is False
    assert per_call[drifted[1]]["names"] == ["reviewer"]

    text = audit("--registry", str(reg.root), str(batch))
    assert text.returncode == 0, text.stderr
    body = text.stdout.decode()
    assert f"4 of 7 requests byte-identical to coding-loop sha {sha(SYSTEM)}" in body
    assert "registered, bytes verified" in body
    assert f"{drifted[0]}: sha {sha(SYSTEM + ' ')[:12]}" in body
    assert "not registered" in body
    assert f"{drifted[1]}: sha {sha(OTHER)[:12]}" in body and "registered as reviewer" in body


def test_requests_alone_and_batch_input_are_read(tmp_path: Path, reg: Registry) -> None:
    lines = [
        orjson.dumps(request(SYSTEM, "a")),
        orjson.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                      "body": request(SYSTEM, "b")}),
        orjson.dumps({"request": {"body": request(OTHER, "c")}}),
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines))
    res = audit("--registry", str(reg.root), "--json", str(tmp_path / "in.jsonl"))
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == 0
    assert out["system_prefix"]["batch_prefix"]["sha256"] == sha(SYSTEM)
    assert out["system_prefix"]["drifted"] == [f"{tmp_path / 'in.jsonl'}:3"]


def test_an_unregistered_batch_prefix_is_said_unregistered(tmp_path: Path) -> None:
    empty = Registry(tmp_path / "empty")
    empty.init()
    batch = tmp_path / "calls.jsonl"
    write_pairs(batch)
    res = audit("--registry", str(empty.root), str(batch))
    assert res.returncode == 0, res.stderr
    assert f"sha {sha(SYSTEM)}" in res.stdout.decode()
    assert "NOT registered in this registry" in res.stdout.decode()


def test_a_corrupt_registered_object_fails_closed(tmp_path: Path, reg: Registry) -> None:
    obj = reg.object_path(sha(SYSTEM))
    obj.chmod(0o644)
    obj.write_bytes(SYSTEM.replace("careful", "carefree").encode())
    batch = tmp_path / "calls.jsonl"
    write_pairs(batch)
    res = audit("--registry", str(reg.root), str(batch))
    assert res.returncode == 3
    assert res.stdout == b""


def test_token_count_match_of_an_unregistered_prefix_says_so() -> None:
    span = PrefixSpan("c" * 64, "b1", 800, 0, "2025-01-01T00:00:00Z", "warm")
    data = AuditInput(calls=[_call(800), _call(810)])
    report = audit_calls(data, known=Known(spans=[span], registered=frozenset()))
    assert report.prefix is not None and report.prefix.registered is False
    text = report.to_text()
    assert "a token-count likeness, not byte identity" in text
    assert "NOT registered in this registry" in text


def test_system_prompt_hashes_exact_utf8_bytes() -> None:
    got = system_prompt(request(SYSTEM, "t"))
    assert got.sha256 == sha(SYSTEM) and got.bytes == len(SYSTEM.encode("utf-8"))
    assert system_prompt({"messages": []}).problem == "no messages"
    assert system_prompt(request("\ud800", "t")).problem == "messages[0].content is not valid UTF-8"


def test_a_fifo_in_a_directory_is_skipped_not_read(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "good.json").write_bytes(orjson.dumps(response(Row(100, 0, 5))))
    os.mkfifo(d / "pipe.json")  # a reader opening this without O_NONBLOCK waits forever
    outside = tmp_path / "outside.json"
    outside.write_bytes(orjson.dumps(response(Row(100, 0, 5))))
    (d / "link.json").symlink_to(outside)
    res = audit("--json", str(d), timeout=20)
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == 1  # neither the FIFO nor the symlinked file was read
    skipped = {s["source"]: s["reason"] for s in out["skipped"]}
    assert skipped == {
        str(d / "link.json"): "a symlink (not followed)",
        str(d / "pipe.json"): "not a regular file (a FIFO)",
    }
    text = audit(str(d), timeout=20).stdout.decode()
    assert "skipped (2):" in text and "not a regular file (a FIFO)" in text


def test_a_fifo_named_directly_is_skipped_and_nothing_read_exits_2(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "p.json")
    data = read_outputs([tmp_path / "p.json"])
    assert data.files == 0 and data.skipped[0].reason == "not a regular file (a FIFO)"
    res = audit(str(tmp_path / "p.json"), timeout=20)
    assert res.returncode == 2


# --------------------------------------------------------------------------------------
# Issue 22: hostile inputs are listed with a reason, within bounded memory, never fatal


def test_a_line_over_the_cap_is_skipped_and_never_held_whole(tmp_path: Path) -> None:
    good = orjson.dumps(response(Row(100, 0, 5)))
    huge = response(Row(100, 0, 5))
    huge["choices"][0]["message"]["content"] = "x" * (3 * MAX_DOCUMENT)  # a 48 MiB line
    path = tmp_path / "calls.jsonl"
    path.write_bytes(good + b"\n" + orjson.dumps(huge) + b"\n" + good + b"\n")
    del huge
    script = (
        "import resource, subprocess, sys;"
        "p = subprocess.run([sys.executable, '-m', 'prefixreg', 'audit', '--json', sys.argv[1]],"
        " capture_output=True);"
        "sys.stdout.buffer.write(p.stdout);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, file=sys.stderr);"
        "sys.exit(p.returncode)"
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == 2
    assert out["skipped"] == [
        {
            "source": f"{path}:2",
            "reason": f"a line over {MAX_DOCUMENT:,} bytes: read past, not parsed",
        }
    ]
    peak_mib = int(res.stderr.split()[-1])
    assert peak_mib < 3 * MAX_DOCUMENT // 2**20 + 40, peak_mib  # well under the line's 48 MiB
    # A .json document over the cap is skipped the same way.
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_DOCUMENT + 1) + good)
    data = read_outputs([big])
    assert data.calls == [] and data.skipped[0].reason.startswith("a JSON document over")


def test_a_1100_level_directory_tree_is_walked_without_recursion(tmp_path: Path) -> None:
    deep = path = tmp_path / "top"
    for _ in range(1100):  # one level at a time: Path.mkdir(parents=True) itself recurses
        path.mkdir()
        path = path / "d"
    path.mkdir()
    (path / "r.json").write_bytes(orjson.dumps(response(Row(100, 0, 5))))
    try:
        res = audit("--json", str(deep))
        assert res.returncode == 0, res.stderr
        assert orjson.loads(res.stdout)["calls"] == 1
    finally:  # one level at a time again: pytest's own cleanup (shutil.rmtree) recurses
        (path / "r.json").unlink()
        while path != tmp_path:
            path.rmdir()
            path = path.parent


def test_every_document_goes_through_the_one_json_reader(tmp_path: Path) -> None:
    deep: Any = [1]
    for _ in range(100):
        deep = [deep]
    nested = response(Row(100, 0, 5)) | {"extra": deep}  # a call output, nested too deep
    path = tmp_path / "c.jsonl"
    path.write_bytes(orjson.dumps(nested) + b"\n" + orjson.dumps(response(Row(100, 0, 5))) + b"\n")
    data = read_outputs([path])
    assert len(data.calls) == 1
    assert data.malformed[0].source == f"{path}:1"
    assert "nested deeper than 64 levels" in data.malformed[0].reason

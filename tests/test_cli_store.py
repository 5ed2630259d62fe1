"""The registry commands as a user runs them: real processes, exit codes, stdout bytes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.conftest import run_cli
from tests.test_store import TRICKY, flip_byte, tree

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def reg(tmp_path: Path) -> Path:
    return tmp_path / "reg"


def test_add_then_cat_is_byte_identical_and_sha256sum_matches(tmp_path: Path, reg: Path) -> None:
    src = tmp_path / "prefix.txt"
    src.write_bytes(TRICKY)
    added = run_cli("add", str(src), "--name", "tricky", "--registry", str(reg))
    assert added.returncode == 0, added.stderr
    sha = added.stdout.decode().strip()
    assert sha == hashlib.sha256(TRICKY).hexdigest()
    cat = run_cli("cat", "tricky", "--registry", str(reg))
    assert cat.returncode == 0
    assert cat.stdout == TRICKY
    obj = reg / "objects" / sha[:2] / f"{sha}.txt"
    out = subprocess.run(["sha256sum", str(obj)], capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == sha


def test_add_from_stdin_and_env_registry(tmp_path: Path, reg: Path) -> None:
    added = run_cli("add", "-", input_bytes=b"from stdin", env={"PREFIXREG_HOME": str(reg)})
    assert added.returncode == 0
    assert (reg / "REGISTRY.json").exists()
    assert run_cli("cat", added.stdout.decode().strip()[:10], "--registry", str(reg)).stdout == (
        b"from stdin"
    )


def test_flipped_byte_makes_cat_and_show_exit_3_with_empty_stdout(
    tmp_path: Path, reg: Path
) -> None:
    src = tmp_path / "p.txt"
    src.write_bytes(b"exact bytes")
    sha = run_cli("add", str(src), "--name", "p", "--registry", str(reg)).stdout.decode().strip()
    flip_byte(reg / "objects" / sha[:2] / f"{sha}.txt")
    for cmd in ("cat", "show"):
        res = run_cli(cmd, "p", "--registry", str(reg))
        assert res.returncode == 3
        assert res.stdout == b""
        assert b"Traceback" not in res.stderr
        assert sha.encode() in res.stderr
        assert len(res.stderr.decode().strip().splitlines()) == 1
    ver = run_cli("verify", "--registry", str(reg), "--json")
    assert ver.returncode == 1
    report = orjson.loads(ver.stdout)
    assert report["ok"] is False
    assert [f["kind"] for f in report["findings"]] == ["corrupt"]


@pytest.mark.parametrize(
    ("args", "stdin", "needle"),
    [
        (["add", "-"], b"", b"empty"),
        (["add", "-"], b"\xff\xfe", b"UTF-8"),
        (["add", "-", "--name", "a" * 64], b"x", b"invalid name"),
        (["add", "-", "--name", "a/b"], b"x", b"invalid name"),
        (["add", "-", "--name", ".dot"], b"x", b"invalid name"),
        (["cat", "../../etc/passwd"], None, b"invalid reference"),
        (["cat", "unknown-name"], None, b"no prefix or frame named"),
        (["cat", "deadbeef00"], None, b"no prefix or frame matches"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    reg: Path, args: list[str], stdin: bytes | None, needle: bytes
) -> None:
    res = run_cli(*args, "--registry", str(reg), input_bytes=stdin)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert b"Traceback" not in res.stderr
    assert res.stderr.startswith(b"error: ")
    assert tree(reg) == {}


def test_registry_path_problems_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    assert run_cli("add", "-", "--registry", str(f), input_bytes=b"x").returncode == 2
    d = tmp_path / "stuff"
    d.mkdir()
    (d / "keep").write_text("x")
    res = run_cli("add", "-", "--registry", str(d), input_bytes=b"x")
    assert res.returncode == 2
    assert tree(d) == {"keep": b"x"}


def test_debug_shows_traceback(reg: Path) -> None:
    res = run_cli("cat", "missing-name", "--registry", str(reg), "--debug")
    assert res.returncode == 2
    assert b"Traceback" in res.stderr


def test_ls_show_names_json(tmp_path: Path, reg: Path) -> None:
    run_cli("add", "-", "--name", "a", "--note", "first", "--registry", str(reg), input_bytes=b"A")
    sha_b = run_cli("add", "-", "--registry", str(reg), input_bytes=b"B").stdout.decode().strip()
    assert run_cli("name", "a", sha_b[:8], "--registry", str(reg)).returncode == 0
    listing = orjson.loads(run_cli("ls", "--json", "--registry", str(reg)).stdout)
    assert {o["sha256"]: o["names"] for o in listing}[sha_b] == ["a"]
    assert orjson.loads(run_cli("names", "--json", "--registry", str(reg)).stdout) == {"a": sha_b}
    log = orjson.loads(run_cli("names", "--log", "--json", "--registry", str(reg)).stdout)
    assert [entry["to"] for entry in log][-1] == sha_b
    assert len(log) == 2
    shown = orjson.loads(run_cli("show", "a", "--json", "--registry", str(reg)).stdout)
    assert shown["sha256"] == sha_b and shown["names"] == ["a"]
    cas = run_cli("name", "a", "A", "--expect", "none", "--registry", str(reg))
    assert cas.returncode == 2


def test_prefix_add_console_script_and_bin_wrapper(tmp_path: Path, reg: Path) -> None:
    src = tmp_path / "p.txt"
    src.write_bytes(b"via prefix-add")
    script = shutil.which("prefix-add", path=str(Path(sys.executable).parent)) or shutil.which(
        "prefix-add"
    )
    assert script is not None, "the prefix-add console script is not installed"
    for argv in ([script], [sys.executable, str(ROOT / "bin" / "prefix-add")]):
        res = subprocess.run(
            [*argv, str(src), "--registry", str(reg)],
            capture_output=True,
            check=False,
            env=dict(os.environ),
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.decode().strip() == hashlib.sha256(b"via prefix-add").hexdigest()


def test_frames_go_wherever_a_prefix_goes(tmp_path: Path, reg: Path) -> None:
    """show, cat, ls and name take a frame as they take a prefix (#21)."""
    from prefixreg.registry.store import Registry

    registry = Registry(reg)
    system = registry.add("You are a coding agent.\n", name="sys")
    tools = '[{"type":"function","function":{"name":"grep","parameters":{"z":1,"a":2}}}]'
    frame = registry.add_frame(system, tools=tools, settings={"tool_choice": "auto"})
    root = ["--registry", str(reg)]
    shown = run_cli("show", frame[:10], *root)
    assert shown.returncode == 0, shown.stderr
    assert b"kind     frame" in shown.stdout and system.encode() in shown.stdout
    data = orjson.loads(run_cli("show", frame, "--json", *root).stdout)
    assert (data["kind"], data["system"], data["settings"]) == (
        "frame",
        system,
        {"tool_choice": "auto"},
    )
    head = run_cli("cat", frame, *root)
    assert head.returncode == 0
    assert orjson.loads(head.stdout) == {
        "system": "You are a coding agent.\n",
        "tools": orjson.loads(tools),
        "settings": {"tool_choice": "auto"},
    }
    assert b'"parameters":{"z":1,"a":2}' in head.stdout  # the tools as written, key order kept
    listing = run_cli("ls", *root).stdout.decode().splitlines()
    assert any(line.startswith(frame[:12]) and " frame " in line for line in listing)
    assert any(line.startswith(system[:12]) and " prefix " in line for line in listing)
    rows = orjson.loads(run_cli("ls", "--json", *root).stdout)
    assert {r["sha256"]: r["kind"] for r in rows}[frame] == "frame"
    # A name that holds a prefix is not moved to a frame (nor back) without --force.
    refused = run_cli("name", "sys", frame, *root)
    assert refused.returncode == 2 and b"--force" in refused.stderr
    assert registry.read_name("sys") == system
    assert run_cli("name", "sys", frame, "--force", *root).returncode == 0
    assert registry.read_name("sys") == frame
    assert run_cli("name", "sys", system, *root).returncode == 2
    assert run_cli("name", "loop", frame, *root).returncode == 0  # a new name: no question
    assert run_cli("cat", "loop", *root).stdout == head.stdout
    assert run_cli("verify", *root).returncode == 0


TOOLS = '[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]'


def test_a_refused_name_writes_nothing_and_its_hint_works(tmp_path: Path, reg: Path) -> None:
    """add/frame --name that would change the name's kind exit 2 before writing anything
    (no object, no tools, no frame record), and the --force the hint names exists."""
    from prefixreg.registry.store import Registry

    registry = Registry(reg)
    registry.add("the system\n", name="loop")
    head = registry.add_frame("loop", tools=TOOLS, name="head")
    root = ["--registry", str(reg)]
    (tmp_path / "new.txt").write_text("brand new text\n")
    (tmp_path / "tools.json").write_text(TOOLS.replace('"f"', '"g"'))
    before = tree(reg)
    for args in (
        ("add", str(tmp_path / "new.txt"), "--name", "head"),
        ("frame", "loop", "--set", 'tool_choice="none"', "--name", "loop"),
        ("frame", "loop", "--tools", str(tmp_path / "tools.json"), "--name", "loop"),
    ):
        refused = run_cli(*args, *root)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.startswith(b"error: name ") and b"--force" in refused.stderr
        assert tree(reg) == before, args  # nothing written, not even a part
    help_text = run_cli("add", "--help").stdout
    assert b"--force" in help_text
    forced = run_cli("add", str(tmp_path / "new.txt"), "--name", "head", "--force", *root)
    assert forced.returncode == 0, forced.stderr
    assert registry.read_name("head") == forced.stdout.decode().strip() != head
    assert run_cli("verify", *root).returncode == 0


def test_verify_of_no_registry_exits_2_and_of_an_empty_one_passes(tmp_path: Path) -> None:
    """A typo'd --registry in a nightly fsck must fail, not pass as 0 objects."""
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    for root in (tmp_path / "nonexist", empty_dir):
        for extra in ([], ["--repair"], ["--json"]):
            res = run_cli("verify", "--registry", str(root), *extra)
            assert res.returncode == 2, res.stderr
            assert res.stdout == b""
            assert res.stderr.count(b"\n") == 1 and b"no registry to verify" in res.stderr
        assert tree(root) == {}  # --repair created nothing
    from prefixreg.registry.store import Registry

    Registry(tmp_path / "real").init()  # a real registry with nothing in it yet
    res = run_cli("verify", "--registry", str(tmp_path / "real"))
    assert res.returncode == 0, res.stderr
    assert res.stderr.startswith(b"ok: 0 objects")


def test_ls_shows_a_frames_tools_as_its_part_not_a_bare_prefix(reg: Path) -> None:
    from prefixreg.registry.store import Registry

    registry = Registry(reg)
    registry.add("the system\n", name="sys")
    frame = registry.add_frame("sys", tools=TOOLS, name="head")
    tools = registry.frame(frame).tools_sha256 or ""
    lines = run_cli("ls", "--registry", str(reg)).stdout.decode().splitlines()
    (row,) = [line for line in lines if line.startswith(tools[:12])]
    assert row.split()[1] == "tools" and f"tools of frame {frame[:12]}" in row
    rows = {
        r["sha256"]: r for r in orjson.loads(run_cli("ls", "--json", "--registry", str(reg)).stdout)
    }
    assert rows[tools]["kind"] == "tools"
    assert rows[tools]["note"] == f"tools of frame {frame[:12]}"
    assert {rows[sha]["kind"] for sha in rows if sha != tools} == {"prefix", "frame"}


def test_show_says_how_many_measurements_it_leaves_out(reg: Path) -> None:
    from prefixreg.core.jsonio import JSONValue
    from prefixreg.core.records import Measurement, ServerBuild
    from prefixreg.registry.store import Registry

    registry = Registry(reg)
    sha = registry.add("measured\n", name="m")
    build = ServerBuild(profile="halogen", identity={"model": "m"})
    for i in range(13):
        at = f"2026-01-01T00:00:{i:02d}.000000Z"
        body: dict[str, JSONValue] = {"verdict": "resumed", "prompt_tokens": 10, "cached_tokens": 9}
        registry.write_measurement(
            Measurement(sha256=sha, at=at, kind="warm", build=build, body=body)
        )
    text = run_cli("show", "m", "--registry", str(reg)).stdout.decode()
    assert "measurements (13, newest last):" in text
    assert "(3 older not shown; show --json lists every one)" in text
    assert sum(" warm " in line for line in text.splitlines()) == 11  # latest + the last 10
    assert "2026-01-01T00:00:12" in text and "2026-01-01T00:00:02" not in text
    shown = orjson.loads(run_cli("show", "m", "--json", "--registry", str(reg)).stdout)
    assert len(shown["measurements"]) == 13

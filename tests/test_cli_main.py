"""The `prefixreg` entry points: what start-up imports, `--version`, and closed stdio.

Real processes throughout; a closed descriptor is closed by the shell (`>&-`, `<&-`)
exactly as a user or a supervisor would do it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import typer

from prefixreg.cli import main
from prefixreg.core.version import package_version
from tests.conftest import run_cli

HEAVY = ("prefixreg.verbs", "prefixreg.server", "prefixreg.sim", "httpx", "rich")


def shell(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`script` run by sh with $PY the interpreter (so redirections close real fds)."""
    full = dict(os.environ, PY=sys.executable, **(env or {}))
    return subprocess.run(
        ["sh", "-c", script, "sh", *args], capture_output=True, env=full, timeout=60, check=False
    )


def test_command_table_matches_what_the_modules_define() -> None:
    """Every command a module defines (`<name>_command`, a group's `<name>_app`; not a
    group's subcommands) is in the table under that module, and registers from it alone."""
    defined: dict[str, str] = {}
    for module in dict.fromkeys(main.COMMAND_MODULES.values()):
        found = vars(importlib.import_module(f"prefixreg.cli.{module}"))
        groups = [v for v in found.values() if isinstance(v, typer.Typer)]
        subcommands = [i.callback for g in groups for i in g.registered_commands]
        for attr, value in found.items():
            group = attr.endswith("_app") and isinstance(value, typer.Typer)
            if group or (attr.endswith("_command") and value not in subcommands):
                defined[attr.rsplit("_", 1)[0]] = module
    assert defined == main.COMMAND_MODULES, "update COMMAND_MODULES in prefixreg/cli/main.py"
    for name in main.COMMAND_MODULES:
        scratch = typer.Typer()
        main._register(scratch, name)
        registered = [i.name for i in scratch.registered_commands]
        assert [*registered, *(g.name for g in scratch.registered_groups)] == [name]


def modules_after(argv: list[str], entry: str, tmp_path: Path) -> set[str]:
    """The prefixreg and heavy modules loaded by running `entry` with `argv`."""
    code = (
        "import sys, orjson\n"
        f"sys.argv = {argv!r}\n"
        "from prefixreg.cli import main\n"
        "try:\n"
        f"    main.{entry}()\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write('MODULES=' + orjson.dumps(sorted(sys.modules)).decode())\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PREFIXREG_HOME=str(tmp_path / "reg")),
        check=False,
    )
    marker = res.stderr.rindex(b"MODULES=")
    return set(orjson.loads(res.stderr[marker + len(b"MODULES=") :]))


def test_prefix_add_imports_only_its_command_module(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    loaded = modules_after(["prefix-add", str(f)], "run_add", tmp_path)
    assert "prefixreg.registry.store" in loaded  # it did add
    cli = {m for m in loaded if m.startswith("prefixreg.cli.")}
    assert cli == {"prefixreg.cli.main", "prefixreg.cli._common", "prefixreg.cli.store_cmds"}
    assert not [m for m in loaded if m.startswith(HEAVY)]


def test_prefixreg_add_and_help_import_no_verb(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    add = modules_after(["prefixreg", "add", str(f)], "run", tmp_path)
    assert not [m for m in add if m.startswith((*HEAVY, "prefixreg.cli.loop_cmds"))]
    helped = modules_after(["prefixreg", "--help"], "run", tmp_path)
    assert not [m for m in helped if m.startswith(HEAVY)]
    assert "prefixreg.registry.store" not in helped


def test_top_level_help_lists_every_command() -> None:
    res = run_cli("--help")
    assert res.returncode == 0
    listed = [
        line.split()[0] for line in res.stdout.decode().split("Commands:")[1].splitlines() if line
    ]
    assert listed == list(main.COMMAND_MODULES)


def test_version() -> None:
    res = run_cli("--version")
    assert res.returncode == 0
    assert res.stdout.decode() == f"prefixreg {package_version()}\n"


@pytest.mark.parametrize("argv", [["ls"], ["--help"], ["--version"], ["add", "FILE"]])
def test_closed_stdout_is_a_one_line_usage_error(tmp_path: Path, argv: list[str]) -> None:
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    args = [str(f) if a == "FILE" else a for a in argv]
    res = shell(
        'exec "$PY" -m prefixreg "$@" >&-', *args, env={"PREFIXREG_HOME": str(tmp_path / "reg")}
    )
    assert res.returncode == 2
    assert res.stderr == b"error: standard output is closed\n"
    assert not (tmp_path / "reg" / "objects").exists()  # refused before doing anything


def test_closed_stdin_fails_only_the_command_that_reads_it(tmp_path: Path) -> None:
    env = {"PREFIXREG_HOME": str(tmp_path / "reg")}
    res = shell('exec "$PY" -m prefixreg add - <&-', env=env)
    assert res.returncode == 2
    assert res.stderr.decode().splitlines()[0] == "error: standard input is closed"
    assert b"Traceback" not in res.stderr
    assert not (tmp_path / "reg" / "objects").exists()
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    ok = shell('exec "$PY" -m prefixreg add "$1" <&-', str(f), env=env)
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.strip()) == 64
    listed = shell('exec "$PY" -m prefixreg ls <&-', env=env)
    assert listed.returncode == 0 and ok.stdout[:12] in listed.stdout


def test_closed_stderr_keeps_exit_codes_and_output(tmp_path: Path) -> None:
    env = {"PREFIXREG_HOME": str(tmp_path / "reg")}
    res = shell('exec "$PY" -m prefixreg cat nosuchname 2>&-', env=env)
    assert res.returncode == 2 and res.stdout == b""
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    added = shell('exec "$PY" -m prefixreg add "$1" 2>&-', str(f), env=env)
    assert added.returncode == 0 and len(added.stdout.strip()) == 64


def test_console_script_wrapper_in_bin_runs_from_a_checkout(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("a prefix\n")
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(
        [sys.executable, str(root / "bin" / "prefix-add"), str(f)],
        capture_output=True,
        timeout=60,
        check=False,
        env=dict(os.environ, PREFIXREG_HOME=str(tmp_path / "reg")),
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip()) == 64


@pytest.mark.parametrize(
    "command",
    [
        ["warm"],
        ["probe"],
        ["doctor"],
        ["keepalive"],
        ["audit"],
        ["mirror"],
        ["pool", "warm"],
        ["snapshot", "restore"],
    ],
)
def test_every_judging_command_points_to_the_one_judge(command: list[str]) -> None:
    res = run_cli(*command, "--help")
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.decode().split())
    assert "Evidence: the one judge" in text, text[-300:]


@pytest.mark.parametrize("kind", ["device", "fifo", "directory"])
def test_user_named_inputs_must_be_regular_files(tmp_path: Path, kind: str) -> None:
    target = {"device": Path("/dev/zero"), "directory": tmp_path}.get(kind)
    if target is None:
        target = tmp_path / "fifo"
        os.mkfifo(target)
    reg = str(tmp_path / "reg")
    system = tmp_path / "system.txt"
    system.write_text("You are a careful agent.\n")
    assert run_cli("add", str(system), "--name", "s", "--registry", reg).returncode == 0
    for args in (["add", str(target)], ["frame", "s", "--tools", str(target)]):
        res = run_cli(*args, "--registry", reg)  # would block or read forever if opened
        assert res.returncode == 2, (args, res.stderr)
        assert b"Traceback" not in res.stderr
        assert b"not a regular file" in res.stderr or b"a directory" in res.stderr, res.stderr


def test_a_user_file_over_the_cap_is_refused(tmp_path: Path) -> None:
    from prefixreg.core.errors import UsageError
    from prefixreg.registry.userfiles import read_user_file

    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 1001)
    assert read_user_file(big, limit=1001) == b"x" * 1001
    with pytest.raises(UsageError, match="larger than 1,000 bytes"):
        read_user_file(big, limit=1000)

"""`prefixreg sim`: options made from `SimConfig`'s fields, each reaching the running server;
a real foreground run; bad input is a one-line usage error."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import typer
from typer.testing import CliRunner

from prefixreg.cli import sim as sim_cli
from prefixreg.core.errors import UsageError
from prefixreg.sim import SimConfig

# The CLI is tested on a throwaway app until `prefixreg.cli.main` registers it.
# tgkill, a signal to one thread of a process: its syscall number on the machines we run on
SYS_TGKILL = {"x86_64": 234, "aarch64": 131}[platform.machine()]
APP_SOURCE = (
    "import typer\n"
    "from prefixreg.cli import sim\n"
    "app = typer.Typer(add_completion=False, rich_markup_mode=None)\n"
    "app.command('sim')(sim.sim_command)\n"
    "app.command('noop')(lambda: None)\n"
    "app()\n"
)


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, rich_markup_mode=None)  # as prefixreg.cli.main
    app.command("sim")(sim_cli.sim_command)
    app.command("noop")(lambda: None)
    return app


def flat(text: str) -> str:
    return "".join(text.split())  # click wraps lines, also after a hyphen


def test_help_lists_every_field_with_its_help_and_default() -> None:
    result = CliRunner().invoke(make_app(), ["sim", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    out = flat(result.output)
    for f in dataclasses.fields(SimConfig):
        assert f"--{f.name.replace('_', '-')}" in out, f.name
        assert flat(sim_cli.option_help(f)) in out, f.name
        assert flat(f.metadata["help"]) in flat(sim_cli.option_help(f))
    for needle in (
        "--max-entries <int> LRU capacity in snapshots. Default: 8 (measured; dense: 3).",
        "Default: 8731 (Halogen's API port).",
        "--dedupe-snapshots / --no-dedupe-snapshots",
        "Default: $PREFIXREG_SIM_API_KEY, else no key.",
        "Default: 0.0855 (fitted).",
        "Time model",
        "prefill-setup-s",
        "2,593/11,374/21,337/43,538",
        "refused",
        "-q, --quiet",
    ):
        assert flat(needle) in out, needle


def other_value(f: dataclasses.Field[Any], tmp_path: Path) -> Any:
    """A valid value for every field that differs from its default (port 0: ephemeral)."""
    special = {
        "profile": "flash",  # dense would refuse the disk tier set below
        "host": "localhost",
        "port": 0,
        "api_key": "cli-key-123",
        "model": "cli-model",
        "cache_dir": str(tmp_path / "tier"),
        "engine": None,  # an engine answers as itself, not Halogen's /health (test_sim_engines)
    }
    default: Any = f.default
    if f.name in special:
        return special[f.name]
    if isinstance(default, bool):
        return not default
    return default * 2 if isinstance(default, float) else default + 1


def test_every_field_set_on_the_command_line_reaches_the_server(tmp_path: Path) -> None:
    values = {f.name: other_value(f, tmp_path) for f in dataclasses.fields(SimConfig)}
    args: list[str] = []
    for name, value in values.items():
        option = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args.append(option if value else "--no-" + option[2:])
        elif value is not None:
            args += [option, str(value)]
    with (
        foreground(args, dict(os.environ)) as run,
        httpx.Client(base_url=run.url, trust_env=False, timeout=10) as http,
    ):
        health = http.get("/health").json()
        assert http.get("/cache").status_code == 401
        key = {"Authorization": "Bearer cli-key-123"}
        assert http.get("/cache", headers=key).json()["max_entries"] == 9
    expected = {k: v for k, v in values.items() if k != "api_key"}
    assert health["simulator"] == {"name": "prefixreg.sim", **expected}
    assert "api_key" not in health["simulator"]  # never shown
    assert (health["model"], health["slots"], health["slot_ctx"]) == ("cli-model", 5, 262_145)


def test_sim_help_reads_the_config_and_loads_no_server() -> None:
    code = (
        "import sys, orjson\n"
        "sys.argv = ['prefixreg', 'sim', '--help']\n"
        "from prefixreg.cli import main\n"
        "try:\n"
        "    main.run()\n"
        "except SystemExit:\n"
        "    pass\n"
        "sys.stderr.write('MODULES=' + orjson.dumps(sorted(sys.modules)).decode())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=False)
    loaded = set(orjson.loads(res.stderr[res.stderr.rindex(b"MODULES=") + 8 :]))
    assert b"--max-entries" in res.stdout
    assert "prefixreg.sim.config" in loaded
    assert not loaded & {"prefixreg.sim.server", "prefixreg.sim.engine", "http.server"}


def test_a_config_of_the_wrong_type_is_a_usage_error() -> None:
    for bad in ({"max_entries": "8"}, {"speed": True}, {"model": 5}, {"dedupe_snapshots": 1}):
        with pytest.raises(UsageError, match=r"^simulator: \w+ must be of type"):
            SimConfig(**bad)
    assert SimConfig(speed=2).speed == 2  # an int is a fine float


def test_bad_option_is_a_usage_error() -> None:
    result = CliRunner().invoke(make_app(), ["sim", "--profile", "nope", "--port", "0"])
    assert result.exit_code == 2
    assert "unknown simulator profile" in result.output


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.1", "example.com"])
def test_the_simulator_listens_on_loopback_only(host: str) -> None:
    # A test and demo peer with no API key by default: never on another interface.
    with pytest.raises(UsageError, match="loopback"):
        SimConfig(host=host)
    for ok in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert SimConfig(host=ok).host == ok
    result = CliRunner().invoke(make_app(), ["sim", "--host", host, "--port", "0"])
    assert result.exit_code == 2 and "loopback" in result.output


def test_a_port_in_use_is_a_bad_argument() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(make_app(), ["sim", "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.output


class Run:
    """A foreground `sim`: its URL, then (once stopped) its exit code and output."""

    url = out = err = ""
    code: int | None = None


@contextmanager
def foreground(args: list[str], env: dict[str, str]) -> Iterator[Run]:
    """`sim` in its own process until the block ends, then Ctrl-C."""
    proc = subprocess.Popen(
        [sys.executable, "-c", APP_SOURCE, "sim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    run = Run()
    line = proc.stderr.readline()
    match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    try:
        if not match:
            pytest.fail(f"no URL on stderr: {line!r}")
        run.url = match.group(1)
        yield run
    finally:
        proc.send_signal(signal.SIGINT)
        run.out, run.err = proc.communicate(timeout=10)
        run.code = proc.returncode


def test_foreground_run_serves_until_interrupted() -> None:
    env = {**os.environ, "PREFIXREG_SIM_API_KEY": "env-secret-123"}
    args = ["--port", "0", "--speed", "100000", "--max-entries", "5"]
    with (
        foreground(args, env) as run,
        httpx.Client(base_url=run.url, trust_env=False, timeout=10) as http,
    ):
        health = http.get("/health").json()
        assert health["slots"] == 4
        assert http.get("/cache").status_code == 401  # the key came from the environment
        headers = {"Authorization": "Bearer env-secret-123"}
        assert http.get("/cache", headers=headers).json()["max_entries"] == 5
        body = {"messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        time.sleep(0.05)
    assert run.code == 0
    assert run.out == ""  # messages go to stderr
    assert "env-secret-123" not in run.err
    assert "sim: chat 24 tok" in run.err  # one log line per call


def test_an_unusable_cache_dir_is_a_usage_error(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(
        make_app(), ["sim", "--port", "0", "--cache-dir", str(blocker / "sub")]
    )
    assert result.exit_code == 2
    assert "cannot use cache_dir" in result.output


def test_ctrl_c_delivered_to_a_serving_thread_still_stops_it() -> None:
    # The kernel hands a process's SIGINT to any thread: sent to the serving thread (as
    # tgkill does here), it must stop the simulator as one sent to the main thread does.
    # A main thread asleep in an untimed wait would never run Python's handler.
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixreg", "sim", "--port", "0", "--quiet"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline().decode()
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, line
        assert httpx.get(match.group(1) + "/health", trust_env=False).status_code == 200
        tasks = sorted(int(t.name) for t in Path(f"/proc/{proc.pid}/task").iterdir())
        serving = [t for t in tasks if t != proc.pid]
        assert serving, tasks  # the serving thread: it has answered
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(SYS_TGKILL, proc.pid, serving[0], signal.SIGINT) == 0
        proc.communicate(timeout=15)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

"""`prefixreg sim`: every option documented with its measured default; a real foreground run."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from prefixreg.cli import sim as sim_cli
from prefixreg.sim import SimConfig
from prefixreg.sim.config import PROFILE_DEFAULTS

# The CLI is tested on a throwaway app until `prefixreg.cli.main` registers it.
APP_SOURCE = (
    "import typer\n"
    "from prefixreg.cli import sim\n"
    "app = typer.Typer(add_completion=False, rich_markup_mode=None)\n"
    "sim.register(app)\n"
    "app.command('noop')(lambda: None)\n"
    "app()\n"
)
NOT_CLI_OPTIONS = {"profile", "host", "port", "api_key", "model"}  # covered separately below


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, rich_markup_mode=None)  # as prefixreg.cli.main
    sim_cli.register(app)
    app.command("noop")(lambda: None)
    return app


def sim_params() -> dict[str, Any]:
    """Option string -> parameter object of the `sim` command (duck-typed: Typer's own click)."""
    group: Any = typer.main.get_command(make_app())
    command = group.commands["sim"]
    return {name: p for p in command.params for name in getattr(p, "opts", [])}


def _fmt(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_config_field_has_an_option_stating_its_default() -> None:
    params = sim_params()
    for f in dataclasses.fields(SimConfig):
        option = "--" + f.name.replace("_", "-")
        assert option in params, option
        if f.name in NOT_CLI_OPTIONS:
            continue
        help_text = getattr(params[option], "help", "") or ""
        assert f"Default: {_fmt(f.default)}" in help_text, (option, help_text)
        dense = PROFILE_DEFAULTS["dense"].get(f.name)
        if dense is not None:
            assert f"dense: {_fmt(dense)}" in help_text, (option, help_text)


def test_help_lists_every_option() -> None:
    result = CliRunner().invoke(make_app(), ["sim", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for option in sim_params():
        if option.startswith("--"):
            assert option in result.output
    assert "127.0.0.1" in result.output
    assert "8731" in result.output
    flat = " ".join(result.output.split())
    for needle in ("Time model", "prefill-setup-s", "2,593/11,374/21,337/43,538", "refused"):
        assert needle in flat


def test_bad_option_is_a_usage_error() -> None:
    result = CliRunner().invoke(make_app(), ["sim", "--profile", "nope", "--port", "0"])
    assert result.exit_code == 2
    assert "unknown simulator profile" in result.output


def _start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", APP_SOURCE, "sim", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
    if not match:
        proc.kill()
        proc.wait()
        pytest.fail(f"no URL on stderr: {line!r}")
    return proc, match.group(1)


def test_foreground_run_serves_until_interrupted() -> None:
    env = {**os.environ, "PREFIXREG_SIM_API_KEY": "env-secret-123"}
    proc, url = _start(["--port", "0", "--speed", "100000", "--max-entries", "5"], env)
    try:
        with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:
            health = http.get("/health").json()
            assert health["slots"] == 4
            assert http.get("/cache").status_code == 401  # the key came from the environment
            headers = {"Authorization": "Bearer env-secret-123"}
            assert http.get("/cache", headers=headers).json()["max_entries"] == 5
            body = {"messages": [{"role": "user", "content": "hi"}]}
            assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert out == ""  # messages go to stderr
    assert "env-secret-123" not in err
    assert "sim: chat 24 tok" in err  # one log line per call


def test_an_unusable_cache_dir_is_a_usage_error(tmp_path: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = CliRunner().invoke(
        make_app(), ["sim", "--port", "0", "--cache-dir", str(blocker / "sub")]
    )
    assert result.exit_code == 2
    assert "cannot use cache_dir" in result.output

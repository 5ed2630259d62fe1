"""Shared fixtures: a scrubbed environment, a registry on tmp_path, a fast simulator, a CLI
runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixreg.registry.store import Registry
from prefixreg.sim import SimConfig, SimServer

_SCRUB = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy")

# A harness that starts the suite as a background job of a non-interactive shell (`cmd &`)
# hands it SIGINT ignored, and every child inherits that: the tests that stop a simulator or
# a keeper with Ctrl-C would wait on a child that cannot hear it. Taken as Python takes it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No test sees the user's registry, worker, key or proxies."""
    for key in list(os.environ):
        if key.startswith("PREFIXREG_") or key in _SCRUB:
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    yield


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    return Registry(tmp_path / "reg")


@pytest.fixture
def sim() -> Iterator[SimServer]:
    """The simulator at 5000x the lane's times: its token counts, 1/5000 of its seconds."""
    with SimServer(SimConfig(speed=5000)) as server:
        yield server


def run_cli(
    *args: str,
    input_bytes: bytes | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[bytes]:
    """Run `python -m prefixreg ARGS` as a real process (exit codes, stdout bytes, stderr)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "prefixreg", *args],
        input=input_bytes,
        capture_output=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )

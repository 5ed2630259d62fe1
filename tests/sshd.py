"""A real OpenSSH server on 127.0.0.1 for the mirror tests, with keys generated per test.

`SshServer.start(workdir)` generates a host key and a user key with `ssh-keygen`, writes an
sshd_config that only listens on 127.0.0.1, allows only that user key, and keeps every file
(pid, authorized keys) inside `workdir`. `ssh_options` are the client options the mirror
needs to reach it (`--ssh-option` values). Nothing here skips: a missing `sshd`/`ssh` is a
test failure, because the mirror's acceptance tests are about the real tools.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it


def require_tools() -> None:
    """Fail (never skip) when the real tools the mirror tests need are missing."""
    missing = [t for t in ("rsync", "ssh", "ssh-keygen") if shutil.which(t) is None]
    if not Path(SSHD).is_file():
        missing.append(SSHD)
    assert not missing, (
        f"missing {', '.join(missing)}: install the Debian packages rsync, openssh-client "
        "and openssh-server (scripts/test does)"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "prefixreg-test", "-f", str(path)],
        check=True,
        capture_output=True,
    )


@dataclass
class SshServer:
    """A running sshd; `stop()` ends it (and only it)."""

    workdir: Path
    port: int = 0
    user_key: Path = field(default_factory=Path)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def ssh_options(self) -> list[str]:
        """`--ssh-option` values that reach this server non-interactively."""
        return [
            f"Port={self.port}",
            f"IdentityFile={self.user_key}",
            "IdentitiesOnly=yes",
            "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null",
            "GlobalKnownHostsFile=/dev/null",
            "LogLevel=ERROR",
        ]

    def dest(self, path: Path) -> str:
        return f"root@{self.host}:{path}"

    @classmethod
    def start(cls, workdir: Path) -> SshServer:
        require_tools()
        workdir.mkdir(parents=True, exist_ok=True)
        host_key = workdir / "host_ed25519"
        user_key = workdir / "user_ed25519"
        _keygen(host_key)
        _keygen(user_key)
        authorized = workdir / "authorized_keys"
        authorized.write_bytes(Path(f"{user_key}.pub").read_bytes())
        authorized.chmod(0o600)
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        server = cls(workdir=workdir, user_key=user_key)
        for _attempt in range(5):  # the free port can be taken between probe and bind
            server.port = _free_port()
            config = workdir / "sshd_config"
            config.write_text(
                "\n".join(
                    [
                        f"Port {server.port}",
                        "ListenAddress 127.0.0.1",
                        f"HostKey {host_key}",
                        f"PidFile {workdir / 'sshd.pid'}",
                        f"AuthorizedKeysFile {authorized}",
                        "StrictModes no",
                        "PermitRootLogin prohibit-password",
                        "PubkeyAuthentication yes",
                        "PasswordAuthentication no",
                        "KbdInteractiveAuthentication no",
                        "UsePAM no",
                        "MaxStartups 100",
                        "MaxSessions 100",
                        "LogLevel ERROR",
                        "",
                    ]
                )
            )
            log = (workdir / "sshd.log").open("ab")
            server.proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(config)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
            log.close()
            if server._wait_listening():
                return server
            server.stop()
        raise AssertionError(f"sshd did not start: {(workdir / 'sshd.log').read_text()}")

    def _wait_listening(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s,
            ):
                if s.recv(4).startswith(b"SSH-"):
                    return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def env_without_agent(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("SSH_AUTH_SOCK", None)
        return env

"""The one ssh connection a remote destination's run shares (an explicit `ControlMaster`).

Role: start and stop the master; hand out the `rsh` argv every rsync and hash of the run
uses. Invariants: the master is started with BatchMode (never a password prompt) and
`ControlPersist=60`, so a master leaked by a killed run ends after a minute of idleness;
an authentication failure surfaces here as one `MirrorError` line, before any rsync runs;
`close` is safe to call twice and never raises.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Sequence
from pathlib import Path

from prefixreg.core.errors import MirrorError
from prefixreg.verbs.mirror.rsync import Destination, build_ssh_command, first_error


class ControlMaster:
    """An ssh control master for one destination, its socket in a private work directory."""

    def __init__(self, dest: Destination, options: Sequence[str], workdir: Path) -> None:
        self.dest, self.options, self.workdir = dest, list(options), workdir
        self.control: str | None = None

    def open(self) -> list[str]:
        """Start the master; return the ssh argv (without host) rsync's `-e` uses."""
        control = str(self.workdir / "cm")
        master = build_ssh_command(self.options, control_path=control)
        master += ["-o", "ControlMaster=yes", "-o", "ControlPersist=60", "-N", "-f"]
        master.append(self.dest.ssh_host)
        err_path = self.workdir / "ssh-master.err"
        # stderr to a file, not a pipe: the backgrounded master keeps it open.
        with err_path.open("wb") as err:
            try:
                proc = subprocess.run(
                    master,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    check=False,
                    timeout=120,
                )
            except FileNotFoundError:
                raise MirrorError("ssh is not installed (not found on PATH)") from None
            except subprocess.TimeoutExpired:
                raise MirrorError(f"ssh to {self.dest.ssh_host} timed out") from None
        if proc.returncode != 0:
            message = first_error(err_path.read_text("utf-8", "replace"))
            raise MirrorError(f"ssh to {self.dest.ssh_host} failed: {message}")
        self.control = control
        client = build_ssh_command(self.options, control_path=control)
        return [*client, "-o", "ControlMaster=no"]

    def close(self) -> None:
        """Stop the master (if one was started)."""
        if self.control is None:
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["ssh", "-o", f"ControlPath={self.control}", "-O", "exit", self.dest.ssh_host],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                check=False,
                timeout=30,
            )
        self.control = None

"""Progress for mirror and migrate: each step on stderr when it is a terminal, nothing extra
on a pipe (the same bytes as before). The terminal is a real pseudo-terminal (`pty`)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

from prefixreg.registry.store import Registry
from prefixreg.registry.treecopy import sync
from tests.conftest import run_cli


def on_tty(*args: str) -> tuple[int, bytes, str]:
    """Run `python -m prefixreg ARGS` with stderr on a pseudo-terminal: (rc, stdout, stderr)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixreg", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end of the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.stdout is not None
    with proc.stdout:
        out = proc.stdout.read()
    rc = proc.wait(timeout=60)
    return rc, out, b"".join(chunks).decode().replace("\r\n", "\n")


def origin(root: Path, n: int = 4) -> Registry:
    reg = Registry(root)
    for i in range(n):
        reg.add(f"prefix {i}\n" * 40, name=f"p{i}")
    return reg


def test_mirror_shows_its_steps_on_a_terminal_and_nothing_extra_on_a_pipe(tmp_path: Path) -> None:
    reg = origin(tmp_path / "reg")
    rc, out, err = on_tty("mirror", "--to", str(tmp_path / "a"), "--registry", str(reg.root))
    assert rc == 0, err
    dest = str(tmp_path / "a")
    assert f"{dest}: comparing, hashing the objects there\n" in err
    assert "re-hashing the 4 objects that travel, at the origin\n" in err
    assert f"{dest}: sending " in err and "(round 1)" in err
    res = run_cli("mirror", "--to", str(tmp_path / "b"), "--registry", str(reg.root))
    assert res.returncode == 0, res.stderr
    piped = res.stderr.decode()
    assert "comparing" not in piped and "re-hashing" not in piped and "round 1" not in piped
    assert len(piped.splitlines()) == 1  # the destination's result line, as before
    assert out.count(b"\n") == res.stdout.count(b"\n")


def test_migrate_shows_its_steps_on_a_terminal_and_nothing_extra_on_a_pipe(
    tmp_path: Path,
) -> None:
    origin(tmp_path / "old")
    units = tmp_path / "units"
    units.mkdir()
    rc, _, err = on_tty(
        "migrate", str(tmp_path / "old"), "--to", str(tmp_path / "new"), "--scan", str(units)
    )
    assert rc == 0, err
    assert f"verifying the registry at {tmp_path / 'old'}\n" in err
    assert "files to " in err and " by rename\n" in err
    assert f"verifying the registry at {tmp_path / 'new'}\n" in err
    assert f"scanning {units} for lines naming" in err
    origin(tmp_path / "old2")
    res = run_cli("migrate", str(tmp_path / "old2"), "--to", str(tmp_path / "new2"))
    assert res.returncode == 0, res.stderr
    assert b"verifying" not in res.stderr and len(res.stderr.splitlines()) == 1  # as before
    # JSON on a terminal: the steps stay off (a script reads it).
    origin(tmp_path / "old3")
    rc, out, err = on_tty("migrate", str(tmp_path / "old3"), "--to", str(tmp_path / "n3"), "--json")
    assert rc == 0 and "verifying" not in err and out.startswith(b"{")


def test_a_long_copy_reports_the_file_it_is_at(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    files = [f"f{i:04d}" for i in range(1001)]
    for rel in files:
        (src / rel).write_bytes(rel.encode())
    heard: list[str] = []
    assert len(sync(src, dst, files, progress=heard.append)) == 1001
    assert heard == ["file 500 of 1,001", "file 1,000 of 1,001", "file 1,001 of 1,001"]

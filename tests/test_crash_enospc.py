"""A full disk never tears the name journal (#22 case 2), on a real tmpfs filled to its last
page: `name` fails and leaves `names.log` exactly as it was (the whole line or nothing, and
no line for a move whose name file could not be written); once space is back the next move,
`verify` and `names --log` all succeed. The short write itself is also driven by a fault at
the write, and a torn tail left by a crash is refused, reported and healed."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry import fsutil
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import repair_registry, verify_registry
from tests.conftest import run_cli as run

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("case", ["torn", "fits"])
def test_a_full_tmpfs_leaves_the_journal_whole(tmp_path: Path, case: str) -> None:
    mount = tmp_path / "mnt"
    mount.mkdir()
    argv = ["unshare", "-rm", sys.executable, "-m", "tests.enospc_writer", str(mount), case]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    got = json.loads(proc.stdout)
    assert got["full"], got
    if case == "torn":
        assert 0 < got["free"] < got["line"], got  # the next line straddles the last page
    assert got["n1"] == 1, got  # the move failed, and said so
    assert got["log_unchanged"], got  # no fragment, and no line for a move not made
    assert (got["n2"], got["verify"], got["names_log"]) == (0, 0, 0), got
    assert got["names"] == ["n0", "n2"]


def test_a_short_write_is_truncated_back(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = registry.add("a\n", name="main")
    b = registry.add("b\n")
    log = registry.root / "names.log"
    before = log.read_bytes()
    real = fsutil._write_all

    def half_then_full(fd: int, data: bytes) -> None:
        if Path(f"/proc/self/fd/{fd}").readlink().name == "names.log":
            os.write(fd, data[: len(data) // 2])  # what a full disk does to one write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(fsutil, "_write_all", half_then_full)
    with pytest.raises(PrefixregError, match=r"No space left.*not moved"):
        registry.move_name("main", b)
    assert log.read_bytes() == before
    monkeypatch.undo()
    assert registry.move_name("other", a) is not None
    assert verify_registry(registry).findings == []
    assert [m.name for m in registry.name_log()] == ["main", "other"]


def test_a_torn_tail_is_refused_reported_and_healed(registry: Registry) -> None:
    a = registry.add("a\n", name="main")
    b = registry.add("b\n")
    log = registry.root / "names.log"
    with log.open("ab") as out:
        out.write(b'{"at":"2026-12-01T00:00:00.000000Z","from":null,"na')  # killed mid-line
    with pytest.raises(IntegrityError, match="torn") as refused:
        registry.move_name("main", b)  # never glued onto the fragment
    assert refused.value.hint is not None and "--repair" in refused.value.hint
    assert registry.read_name("main") == a
    names = run("names", "--log", "--json", "--registry", str(registry.root))
    assert names.returncode == 0 and len(json.loads(names.stdout)) == 1  # committed lines only
    assert run("verify", "--registry", str(registry.root)).returncode == 1
    report = repair_registry(registry)
    assert report.ok, report.findings
    assert any("torn" in done for done in report.repaired)
    assert log.read_bytes().endswith(b"\n")
    assert registry.move_name("main", b) is not None
    assert run("verify", "--registry", str(registry.root)).returncode == 0

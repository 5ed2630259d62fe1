"""Crash safety (SIGKILL at random moments) and concurrent writers losing no update."""

from __future__ import annotations

import itertools
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefixreg.registry.store import Registry
from prefixreg.registry.verify import repair_registry, verify_registry

ROOT = Path(__file__).resolve().parent.parent


def _writer(root: Path, seed: int, count: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.writer", str(root), str(seed), str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def started(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a writer's "started" line: a kill timed from it lands mid-work, however long
    the interpreter took to start on a loaded machine."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line == b"started\n", (line, proc.stderr.read() if proc.stderr else b"")


def _assert_every_visible_record_verifies(reg: Registry) -> None:
    report = verify_registry(reg)
    # A move killed between its journal line and its rename is reported (and repaired).
    problems = [f for f in report.findings if f.severity == "problem" and f.kind != "journal"]
    assert problems == [], problems
    if not report.ok:
        report = repair_registry(reg)
    problems = [f for f in report.findings if f.severity == "problem"]
    assert problems == [], problems
    assert {f.kind for f in report.findings} <= {"stray", "incomplete"}
    for sha in reg.iter_shas():
        reg.get(sha)  # raises IntegrityError if any visible object is torn
    for name in reg.names():
        reg.get(name)  # no name points nowhere


def test_sigkill_at_random_moments_never_leaves_a_bad_visible_record(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    Registry(root).init()
    rng = random.Random(1234)
    killed = 0
    for round_ in range(25):
        proc = _writer(root, round_, 10_000)
        started(proc)
        time.sleep(0.05 + rng.random() * 0.3)  # mid-write
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.communicate(timeout=60)  # closes its pipes
    assert killed >= 20
    reg = Registry(root)
    assert len(list(reg.iter_shas())) > 25
    _assert_every_visible_record_verifies(reg)
    # Strays are reported as strays: make one visible on purpose and check the distinction.
    stray = root / "meta" / ".deadbeef.json.x1.tmp"
    stray.write_bytes(b"{")
    kinds = {(f.kind, f.severity) for f in verify_registry(reg).findings}
    assert ("stray", "warning") in kinds
    assert verify_registry(reg).ok


def test_concurrent_writers_lose_no_update(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    procs = [_writer(root, seed, 40) for seed in range(4)]
    moved = 0
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
        moved += out.decode().count("moved")
    reg = Registry(root)
    log = reg.name_log()
    assert len(log) == moved  # one journal line per move, none lost or doubled
    names = reg.names()
    assert set(names) == {"n0", "n1", "n2"}
    for name, sha in names.items():
        last = [m for m in log if m.name == name][-1]
        assert last.to_sha == sha  # the journal's last move is where the name points
    # Each move's "from" is the previous move's "to": compare-and-swap under the lock.
    for name in names:
        chain = [m for m in log if m.name == name]
        assert chain[0].from_sha is None
        assert all(a.to_sha == b.from_sha for a, b in itertools.pairwise(chain))
    report = verify_registry(reg)
    assert report.findings == []
    assert report.objects == len(list(reg.iter_shas())) > 40

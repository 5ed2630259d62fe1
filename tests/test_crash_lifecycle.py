"""Crash safety of the lifecycle: writers doing add, name moves, measurement writes and gc
(concurrently, two at a time) are SIGKILLed at random moments, many times; afterwards every
visible record verifies and no name points nowhere. Bounded by a kill count, not wall time.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from prefixreg.registry.gc import collect_garbage
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import repair_registry, verify_registry
from tests.test_crash_concurrency import started

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 14  # two writers per round: 28 kills at most


def _writer(root: Path, seed: int, count: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.lifecycle_writer", str(root), str(seed), str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _assert_consistent(reg: Registry) -> None:
    report = verify_registry(reg)
    if any(f.kind == "journal" for f in report.findings):
        report = repair_registry(reg)  # a move killed between its journal line and rename
    problems = [f for f in report.findings if f.severity == "problem"]
    assert problems == [], problems
    assert {f.kind for f in report.findings} <= {"stray", "incomplete"}
    for sha in reg.iter_shas():
        reg.get(sha)  # no torn object is visible
    for name in reg.names():
        reg.get(name)  # no name points nowhere
    for sha in reg.iter_shas():
        if (reg.root / "meta" / f"{sha}.json").exists():
            assert reg.meta(sha).sha256 == sha
    reg.measurements()  # every measurement record parses
    reg.name_log()  # every journal line parses


def test_sigkill_during_add_move_measure_and_gc(tmp_path: Path) -> None:
    root = tmp_path / "reg"
    Registry(root).init()
    rng = random.Random(4321)
    killed = 0
    for round_ in range(ROUNDS):
        procs = [_writer(root, round_ * 2 + k, 100_000) for k in range(2)]
        for proc in procs:
            started(proc)
        time.sleep(0.1 + rng.random() * 0.4)  # mid-work
        for proc in procs:
            time.sleep(rng.random() * 0.05)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed += 1
        for proc in procs:
            _out, err = proc.communicate(timeout=30)
            assert proc.returncode == -signal.SIGKILL, err.decode()  # no writer crashed
    assert killed >= ROUNDS * 2 - 2
    reg = Registry(root)
    assert reg.name_log()  # some moves happened (how many depends on the machine's load)
    _assert_consistent(reg)
    # The debris is gc's to collect: afterwards only warnings gc cannot fix remain.
    collect_garbage(reg, grace_s=0, now=time.time() + 120)  # past the in-flight floor
    _assert_consistent(reg)
    assert "stray" not in {f.kind for f in verify_registry(reg).findings}

"""The write-ahead name journal (#12): `names.log` is durable before a name moves; a failed
journal write leaves the name unmoved; `verify` reports a name that disagrees with its last
journal line and `verify --repair` completes (or rolls back) an interrupted move."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixreg.core.errors import IntegrityError, PrefixregError
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import repair_registry, verify_registry
from tests.conftest import run_cli as run
from tests.test_crash_concurrency import started

ROOT = Path(__file__).resolve().parent.parent
KILLS = 50


def _journal_line(name: str, frm: str | None, to: str) -> bytes:
    line = {"at": "2026-12-01T00:00:00.000000Z", "name": name, "from": frm, "to": to}
    return json.dumps(line, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _last_to(root: Path) -> dict[str, str]:
    """Each name's last journalled `to`, parsed here independently of the store."""
    last: dict[str, str] = {}
    log = root / "names.log"
    for line in log.read_bytes().splitlines() if log.exists() else []:
        entry = json.loads(line)
        last[entry["name"]] = entry["to"]
    return last


def _name_files(root: Path) -> dict[str, str]:
    names = root / "names"
    return {p.name: p.read_text()[:64] for p in names.iterdir() if not p.name.startswith(".")}


def _check_and_repair(reg: Registry) -> int:
    """Every disagreement between names/ and names.log is reported by verify, and
    repaired by repair; returns how many there were."""
    journal, files = _last_to(reg.root), _name_files(reg.root)
    disagree = {n for n in set(journal) | set(files) if journal.get(n) != files.get(n)}
    report = verify_registry(reg)
    reported = {f.path.removeprefix("names/") for f in report.findings if f.kind == "journal"}
    assert reported == disagree  # every disagreement is reported, and nothing else
    others = [f for f in report.findings if f.severity == "problem" and f.kind != "journal"]
    assert others == []
    if disagree:
        repaired = repair_registry(reg)
        assert repaired.ok, repaired.findings
        assert len(repaired.repaired) == len(disagree)
        assert _last_to(reg.root) == _name_files(reg.root)  # agree again
    return len(disagree)


def test_sigkill_during_adds_and_name_moves_every_name_agrees_or_is_reported(
    tmp_path: Path,
) -> None:
    root = tmp_path / "reg"
    reg = Registry(root)
    reg.init()
    rng = random.Random(2026)
    killed = seen = 0
    for round_ in range(KILLS):
        # One writer mostly moving names, one mostly adding (and moving) in some rounds.
        argv = [sys.executable, "-m", "tests.writer", str(root), str(round_), "100000"]
        runs = [[*argv, "moves"], argv] if round_ % 3 == 0 else [[*argv, "moves"]]
        procs = [
            subprocess.Popen(a, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for a in runs
        ]
        for proc in procs:
            started(proc)
        time.sleep(0.1 + rng.random() * 0.4)  # mid-work
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                killed += 1
        for proc in procs:
            _out, err = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL, err.decode()  # no writer crashed
        # Checked after every round: a later move would otherwise hide an earlier crash.
        seen += _check_and_repair(reg)
    assert killed >= KILLS
    assert seen >= 1  # some kill did land between a journal line and its rename
    for name in reg.names():
        reg.get(name)  # every name points at bytes that verify


def test_an_interrupted_move_is_reported_and_repair_completes_it(registry: Registry) -> None:
    a = registry.add("a\n", name="main")
    b = registry.add("b\n")
    # What a kill between the journal line and the rename leaves behind.
    with (registry.root / "names.log").open("ab") as log:
        log.write(_journal_line("main", a, b))
    report = verify_registry(registry)
    assert not report.ok
    [finding] = [f for f in report.findings if f.kind == "journal"]
    assert finding.path == "names/main"
    assert "interrupted move" in finding.message and "--repair" in finding.message
    result = run("verify", "--registry", str(registry.root), "--repair")
    assert result.returncode == 0, result.stdout + result.stderr
    assert b"completed the move" in result.stdout
    assert registry.read_name("main") == b
    assert verify_registry(registry).findings == []


def test_repair_completes_an_interrupted_move_to_a_frame(registry: Registry) -> None:

    a = registry.add("system a\n", name="head")
    frame = registry.add_frame(a, settings={"tool_choice": "none"})
    with (registry.root / "names.log").open("ab") as log:
        log.write(_journal_line("head", a, frame))
    report = repair_registry(registry)
    assert report.ok, report.findings
    assert registry.read_name("head") == frame  # completed: the frame verifies


def test_repair_rolls_back_a_move_whose_object_is_gone(registry: Registry) -> None:
    a = registry.add("a\n", name="main")
    missing = "e" * 64
    with (registry.root / "names.log").open("ab") as log:
        log.write(_journal_line("main", a, missing))
    report = repair_registry(registry)
    assert report.ok, report.findings
    assert registry.read_name("main") == a  # rolled back: the name keeps its value
    last = registry.name_log()[-1]
    assert (last.from_sha, last.to_sha) == (missing, a)


def test_a_journal_that_is_a_symlink_leaves_the_name_unmoved(
    registry: Registry, tmp_path: Path
) -> None:
    a = registry.add("a\n", name="s1")
    b = registry.add("b\n")
    outside = tmp_path / "outside.log"
    outside.write_bytes(b"")
    log = registry.root / "names.log"
    log.unlink()
    log.symlink_to(outside)
    with pytest.raises(IntegrityError, match="symlink"):
        registry.move_name("s1", b)
    assert registry.read_name("s1") == a
    result = run("name", "s1", b, "--registry", str(registry.root))
    assert result.returncode == 3, result.stderr
    assert b"not moved" in result.stderr
    assert registry.read_name("s1") == a
    assert outside.read_bytes() == b""  # nothing written through the link


def test_an_unwritable_journal_leaves_the_name_unmoved(registry: Registry) -> None:
    a = registry.add("a\n", name="s1")
    b = registry.add("b\n")
    log = registry.root / "names.log"
    log.unlink()
    log.mkdir()  # open(O_WRONLY) fails whatever the user's privileges
    with pytest.raises(PrefixregError, match="not moved"):
        registry.move_name("s1", b)
    assert registry.read_name("s1") == a
    with pytest.raises(PrefixregError):
        registry.move_name("fresh", b)
    assert registry.read_name("fresh") is None  # a new name is not created either


def test_verify_reports_a_name_changed_behind_the_journal(registry: Registry) -> None:
    registry.add("a\n", name="main")
    b = registry.add("b\n")
    (registry.root / "names" / "main").write_text(b + "\n")  # moved by hand, not journalled
    report = verify_registry(registry)
    assert [f.kind for f in report.findings] == ["journal"]
    repaired = repair_registry(registry)
    assert repaired.ok and registry.name_log()[-1].to_sha == b


def test_gc_keeps_the_object_of_an_interrupted_move(registry: Registry) -> None:
    from prefixreg.registry.gc import collect_garbage

    a = registry.add("a\n", name="main")
    b = registry.add("b\n")  # unnamed, and old by gc's clock below
    with (registry.root / "names.log").open("ab") as log:
        log.write(_journal_line("main", a, b))
    collect_garbage(registry, grace_s=0, prune_unnamed=True, now=time.time() + 3600)
    assert registry.read_verified(b) == b"b\n"  # so --repair can still complete the move
    repair_registry(registry)
    assert registry.read_name("main") == b

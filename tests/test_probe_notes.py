"""`probe` on a terminal says what it does while it runs: the plan, a line per leg as it
answers, and, after the first cold leg, an estimate of the rest. Run under a real
pseudo-terminal (the CLI's stderr is a TTY there), against the simulator."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.probe.notes import Rate, duration, estimate, plan, planned_calls
from prefixreg.verbs.probe.options import ProbeOptions

ROOT = Path(__file__).resolve().parent.parent


def run_on_a_tty(*args: str) -> tuple[int, str, bytes]:
    """Run `python -m prefixreg ARGS` with stderr on a pseudo-terminal: (exit, tty text, stdout)."""
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "TERM": "dumb"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixreg", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    seen = bytearray()
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=60)  # the report is short: the pipe never fills
    os.close(master)
    return proc.returncode, seen.decode("utf-8", "replace"), out


def test_probe_on_a_terminal_prints_its_plan_each_leg_and_an_estimate(tmp_path: Path) -> None:
    with SimServer(SimConfig(speed=2)) as sim:
        code, tty, stdout = run_on_a_tty(
            "probe", "--worker", sim.url, "--registry", str(tmp_path / "reg"),
            "--sizes", "4k,16k", "--foreign", "2",
        )  # fmt: skip
    assert code == 0, tty
    lines = [line.strip() for line in tty.replace("\r", "\n").splitlines()]
    assert any(
        line.startswith("probe: 2 sizes (4,000 to 16,000 characters), 12 calls") for line in lines
    )
    for leg in ("A1", "A2", "B", "C"):
        for size in ("4,000", "16,000"):
            assert any(line.startswith(f"{leg} {size} chars: ") for line in lines), (leg, size)
    assert any(line.startswith("2 foreign prompts in ") for line in lines)
    assert any(line.startswith("estimate: about ") for line in lines), tty
    # The estimate comes after the first leg and before the long ones.
    first = next(i for i, line in enumerate(lines) if line.startswith("estimate"))
    assert first < next(i for i, line in enumerate(lines) if line.startswith("A1 16,000"))
    assert b"# Probe" in stdout  # the report itself still goes to stdout


def test_probe_off_a_terminal_prints_no_progress(tmp_path: Path) -> None:
    with SimServer(SimConfig(speed=5000)) as sim:
        res = subprocess.run(
            [sys.executable, "-m", "prefixreg", "probe", "--worker", sim.url,
             "--registry", str(tmp_path / "reg"), "--sizes", "4k", "--foreign", "2"],
            capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
        )  # fmt: skip
    assert res.returncode == 0 and b"A1 4,000 chars" not in res.stderr


def test_the_estimate_prices_the_plans_cold_prefills() -> None:
    options = ProbeOptions(sizes=(4000, 16000), foreign=2, foreign_chars=2000)
    assert planned_calls(options) == 3 * 2 + 3 * 2
    rate = Rate(tokens_per_s=100.0, chars_per_token=2.0)
    seconds, line = estimate(options, rate, done=1)
    # Cold: A1 at 16k, C at 4k and 16k, 2 x 2 foreign prompts of 2k; A1 at 4k already ran.
    assert seconds == (16000 + 4000 + 16000 + 4 * 2000) / 2.0 / 100.0
    assert "for the other 11 calls" in line and duration(seconds) in line
    # Before any call: the measured lane's rate, said as the lane's.
    big = ProbeOptions(sizes=(300_000,), foreign=9)
    assert plan(big).startswith("probe: 1 size (300,000 characters), 13 calls")
    assert "on the measured Halogen Flash lane" in plan(big) and " min " in plan(big)
    assert "lane" not in plan(ProbeOptions(sizes=(4000,), foreign=2))
    assert (
        duration(45) == "45 s" and duration(132) == "2 min 12 s" and duration(3780) == "1 h 3 min"
    )

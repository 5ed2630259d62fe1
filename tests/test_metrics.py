"""`--metrics-file`: Prometheus textfile metrics that Prometheus' own parser reads."""

from __future__ import annotations

import errno
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixreg.core.errors import UsageError
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.measure.metrics import Metrics, write_metrics
from tests.conftest import run_cli


def families(path: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def test_warm_writes_metrics_that_match_its_receipt(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add("You are a careful coding agent. Keep the house style.\n" * 60, name="loop")
    prom = tmp_path / "textfile" / "prefixreg.prom"
    prom.parent.mkdir()
    with SimServer(SimConfig(speed=1000)) as sim:
        args = ["warm", "loop", "--worker", sim.url, "--registry", str(reg.root)]
        res = run_cli(*args, "--json", "--metrics-file", str(prom))
    assert res.returncode == 0, res.stderr
    body = orjson.loads(res.stdout)["body"]
    got = families(prom)
    verdicts = {labels["verdict"]: v for labels, v in got["prefixreg_warm_verdict"]}
    assert verdicts == {
        "resumed": 1.0,
        "partial": 0.0,
        "cold": 0.0,
        "unverified": 0.0,
        "warmed": 0.0,
    }
    ((labels, cached),) = got["prefixreg_warm_cached_tokens"]
    assert cached == body["cached_tokens"] and labels["name"] == "loop"
    assert got["prefixreg_warm_span_tokens"][0][1] == body["span_tokens"]
    assert math.isclose(got["prefixreg_warm_coverage_ratio"][0][1], body["coverage"])
    assert not list(prom.parent.glob("*.tmp")) and not list(prom.parent.glob(".*"))


def test_a_missing_metrics_directory_is_refused_before_anything_runs(tmp_path: Path) -> None:
    res = run_cli(
        "warm",
        "x",
        "--worker",
        "http://127.0.0.1:9",
        "--metrics-file",
        str(tmp_path / "no" / "m.prom"),
    )
    assert res.returncode == 2 and b"does not exist" in res.stderr


def test_labels_are_escaped_and_names_checked(tmp_path: Path) -> None:
    m = Metrics()
    m.set("prefixreg_rewarms_total", 3, "Re-warms", {"outcome": 'a "b"\\\nc'}, kind="counter")
    m.set("prefixreg_kept_heads", 2, "Heads kept")
    write_metrics(tmp_path / "m.prom", m)
    got = families(tmp_path / "m.prom")
    assert got["prefixreg_rewarms_total"] == [({"outcome": 'a "b"\\\nc'}, 3.0)]
    assert got["prefixreg_kept_heads"] == [({}, 2.0)]
    bad: list[tuple[str, object, dict[str, str], str]] = [
        ("rewarms_total", 1, {}, "counter"),  # not ours
        ("prefixreg_rewarms", 1, {}, "counter"),  # a counter without _total
        ("prefixreg_x", math.nan, {}, "gauge"),
        ("prefixreg_x", True, {}, "gauge"),
        ("prefixreg_x", 1, {"bad-label": "v"}, "gauge"),
    ]
    for name, value, labels, kind in bad:
        with pytest.raises(UsageError):
            m.set(name, value, "x", labels, kind=kind)  # type: ignore[arg-type]


def test_a_keepalive_runs_counters_match_its_summary(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add("You are a careful coding agent. Keep the house style.\n" * 60, name="loop")
    prom = tmp_path / "keepalive.prom"
    with SimServer(SimConfig(speed=5000)) as sim, Worker(sim.url) as tenant:
        args = ["keepalive", "loop", "--worker", sim.url, "--registry", str(reg.root)]
        more = ["--budget", "2", "--duration", "3", "--poll", "0.02", "--json"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefixreg", *args, *more, "--metrics-file", str(prom)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 2.5
        n = 0
        while time.monotonic() < deadline:  # another tenant's prompts: the head must be re-warmed
            n += 1
            tenant.chat(f"Tenant {n} has its own system prompt. " * 25, "hi")
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    summary = orjson.loads(out)
    assert summary["rewarms"] >= 3 and summary["resumed"] >= 1
    got = families(prom)
    rewarms = {labels["outcome"]: v for labels, v in got["prefixreg_rewarms_total"]}
    assert rewarms == {k: summary[k] for k in ("resumed", "partial", "cold", "unverified")}
    assert sum(rewarms.values()) == summary["rewarms"]
    expect = {
        "prefixreg_resumed_tokens_total": summary["tokens_saved"],
        "prefixreg_rewarm_spent_tokens_total": summary["tokens_spent"],
        "prefixreg_counter_polls_total": summary["polls"],
        "prefixreg_counter_polls_skipped_total": summary["skipped_polls"],
        "prefixreg_worker_errors_total": summary["errors"],
        "prefixreg_prefill_avoided_tokens_total": summary["snapshots"]["prefill_tokens_avoided"],
    }
    for name, value in expect.items():
        ((labels, sample),) = got[name]
        assert sample == value and labels == {"worker": sim.url}, name
    assert summary["tokens_saved"] > 0
    restores = {labels["outcome"]: v for labels, v in got["prefixreg_snapshot_restores_total"]}
    assert restores == {"restored": 0, "not_proven": 0}
    text = prom.read_text()
    assert "# TYPE prefixreg_rewarms_total counter" in text
    assert not list(tmp_path.glob(".*"))


def test_pool_warm_and_doctor_write_their_report_as_gauges(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    for i in range(3):
        reg.add(f"Pool head {i}: you answer tickets for team {i}.\n" * 40, name=f"p{i}")
    with SimServer(SimConfig(speed=1000)) as a, SimServer(SimConfig(speed=1000)) as b:
        pool = tmp_path / "pool.toml"
        pool.write_text(
            f'[[workers]]\nurl = "{a.url}"\ncapacity = 1\n[[workers]]\nurl = "{b.url}"\n'
            "capacity = 1\n"
        )
        common = ("--pool", str(pool), "--registry", str(reg.root))
        prom = tmp_path / "pool.prom"
        res = run_cli(
            "pool", "warm", "p0", "p1", "p2", *common, "--json", "--metrics-file", str(prom)
        )
        assert res.returncode == 1, res.stderr  # p2 is refused: the pool keeps two heads
        report = orjson.loads(res.stdout)
        got = families(prom)
        assert got["prefixreg_pool_ok"] == [({"command": "pool warm"}, 0.0)]
        assert got["prefixreg_pool_refused_heads"][0][1] == len(report["refused"]) == 1
        held = {(p["worker"], p["sha256"][:16]): p for w in report["workers"] for p in w["holds"]}
        resident = {
            (lab["worker"], lab["head"]): v for lab, v in got["prefixreg_pool_head_resident"]
        }
        assert resident == {k: float(p["resident"]) for k, p in held.items()} and len(held) == 2
        up = {lab["worker"]: v for lab, v in got["prefixreg_pool_worker_up"]}
        assert up == {a.url: 1.0, b.url: 1.0}
        res = run_cli("pool", "doctor", *common, "--metrics-file", str(prom))
        assert res.returncode == 0, res.stdout + res.stderr
        got = families(prom)
        assert got["prefixreg_pool_ok"] == [({"command": "pool doctor"}, 1.0)]
        assert sum(v for _, v in got["prefixreg_pool_head_resident"]) == 2


@pytest.mark.parametrize("flag", ["--metrics-file", "--html"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_output_path_holding_no_regular_file_is_refused_before_anything_runs(
    tmp_path: Path, kind: str, flag: str
) -> None:
    target = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    reply = tmp_path / "reply.json"
    reply.write_bytes(orjson.dumps({"usage": {"prompt_tokens": 10, "completion_tokens": 1}}))
    args = (
        ("audit", str(reply))
        if flag == "--html"
        else ("warm", "x", "--worker", "http://127.0.0.1:9")
    )
    res = run_cli(*args, flag, str(target))
    assert res.returncode == 2, res.stderr
    assert f"{flag} {target}: ".encode() in res.stderr and b"refused" in res.stderr
    assert target.is_fifo() if kind == "fifo" else target.is_dir()  # left as it was
    with pytest.raises(UsageError):
        write_metrics(target, Metrics())  # the library refuses it too


def test_a_metrics_file_that_cannot_be_written_is_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A full disk at the write (a fault a tmpfs would also give): the command's outcome keeps
    # its exit code, and the warning names the file.
    from prefixreg.cli import _common
    from prefixreg.verbs.measure import metrics

    def full(_path: Path, _m: Metrics) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics, "write_metrics", full)
    _common.write_metrics_file(tmp_path / "m.prom", Metrics())
    err = capsys.readouterr().err
    assert (
        err
        == f"warning: --metrics-file {tmp_path / 'm.prom'} not written: No space left on device\n"
    )

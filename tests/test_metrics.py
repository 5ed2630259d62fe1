"""`--metrics-file`: Prometheus textfile metrics that Prometheus' own parser reads."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixreg.core.errors import UsageError
from prefixreg.registry.store import Registry
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

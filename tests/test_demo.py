"""`prefixreg demo`: the newcomer's main job runs end to end on the built-in simulator."""

from __future__ import annotations

from pathlib import Path

import orjson

from prefixreg.cli.sim import sample_prompt
from prefixreg.registry.store import Registry
from prefixreg.registry.verify import verify_registry
from tests.conftest import run_cli


def test_demo_adds_warms_probes_and_leaves_records(tmp_path: Path) -> None:
    reg_path = tmp_path / "demo-reg"
    res = run_cli("demo", "--registry", str(reg_path), "--speed", "500", "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["registry"] == str(reg_path)
    assert out["warm"]["body"]["verdict"] == "resumed"
    assert out["probe"]["survival"] == 3
    reg = Registry(reg_path)
    assert reg.get("coding-agent").data == sample_prompt()
    assert len(reg.measurements(reg.resolve("coding-agent"))) == 1
    assert list((reg_path / "probes").glob("*.md"))
    assert verify_registry(reg).ok


def test_demo_text_report_names_the_numbers(tmp_path: Path) -> None:
    res = run_cli("demo", "--speed", "500", env={"TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode()
    for needle in ("1. add", "2. warm", "RESUMED", "3. probe", "Cmax", "survives 3"):
        assert needle in text
    assert "prefixreg-demo-" in text  # a fresh temporary registry by default
    # Every size resumed whole: Cmax is a lower bound, and the headline says so too.
    assert "Cmax is at least 11,355" in text and "probe  Cmax at least 11,355 tokens" in text

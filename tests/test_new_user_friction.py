"""What a new user hit on the seed's workflow (#33, item 15), each against the real part: the
mirror refusing the worker's hand-built copy names the way out; `show` of an adopted object
shows the person's own records; keepalive's summary neither calls a first warm "not kept" nor
keeps quiet about a burst only more cache entries can survive; audit's seconds and curve say
what the numbers support; exit 130 is documented; a mistyped name gets a "did you mean"."""

from __future__ import annotations

import json
import re
from pathlib import Path

import orjson
import pytest

from prefixreg.cli._common import ExitCode
from prefixreg.core.judge import judge_burst
from prefixreg.registry.location import default_registry_path
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimServer
from prefixreg.verbs.audit.html import series
from prefixreg.verbs.audit.saving import CallSaving
from prefixreg.verbs.keepalive.run import KeepAlive
from tests.conftest import run_cli
from tests.test_keepalive import SYSTEM, Foreign, run_loop
from tests.test_migrate_seed import build_seed
from tests.test_mirror import make_origin, one_error_line, run_mirror_cli
from tests.test_store import tree

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home whose XDG state directory lies inside it (`~/.local/state`, as on Linux)."""
    home = tmp_path / "home"
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    return home


# -- the mirror and the worker's old copy -----------------------------------------------------


def test_mirroring_onto_the_workers_hand_built_copy_says_what_to_do(tmp_path: Path) -> None:
    reg = make_origin(tmp_path / "reg")
    old_copy, _ = build_seed(tmp_path / "worker")  # the seed's REMOTE_PATH: no REGISTRY.json
    before = tree(old_copy)
    res = run_mirror_cli("--registry", str(reg.root), "--to", str(old_copy))
    assert res.returncode == 6, res.stderr
    line = one_error_line(res)  # the way out is in the one line, not a hint below it
    assert "nothing deleted" in line and "new path" in line
    assert f"prefixreg migrate {old_copy} --repoint" in line
    assert tree(old_copy) == before


# -- show of an adopted object ----------------------------------------------------------------


def test_show_of_an_adopted_object_shows_the_persons_own_records(home: Path) -> None:
    seed, shas = build_seed(home)
    meta = {
        "sha": shas[0],
        "source": "/home/ana/prompts/system.txt",
        "added": "2026-09-01 10:00",
        "tokens": 788,
    }
    (seed / "meta" / f"{shas[0]}.json").write_text(json.dumps(meta, indent=2) + "\n")
    assert run_cli("migrate", str(seed), "--repoint").returncode == 0
    new = default_registry_path()

    shown = run_cli("show", shas[0], "--registry", str(new))
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode()
    assert "legacy records (2, byte-identical" in text
    line = next(ln for ln in text.splitlines() if f"meta/{shas[0]}.json:" in ln)
    for said in ("source /home/ana/prompts/system.txt", "added 2026-09-01 10:00", "tokens 788"):
        assert said in line
    measured = next(ln for ln in text.splitlines() if "measurements/" in ln)
    assert "cold_s 17.2" in measured and "warm_s 0.41" in measured
    as_json = orjson.loads(run_cli("show", shas[0], "--registry", str(new), "--json").stdout)
    records = {r["path"]: r["record"] for r in as_json["legacy"]}
    assert records[f"meta/{shas[0]}.json"] == meta
    # The other object's records are its own, not this one's.
    assert all(shas[1] not in path for path in records)


# -- keepalive's summary ----------------------------------------------------------------------


def test_a_heads_first_warm_is_not_counted_as_not_kept(sim: SimServer, tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    with Worker(sim.url, timeout=5.0) as kw:
        keeper = KeepAlive(kw, [reg.get("loop")])
        keeper.step()
    s = keeper.summary
    assert (s.rewarms, s.cold) == (1, 1)  # the judge's verdict stays what it is
    assert "1 first warm (nothing kept yet)" in str(s) and "0 not kept" in str(s)


def test_a_burst_between_polls_is_said_with_its_numbers(sim: SimServer, tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    foreign = Foreign(sim.url)
    try:
        with Worker(sim.url, timeout=5.0) as kw:
            keeper = KeepAlive(kw, [reg.get("loop")])
            keeper.step()  # the first warm
            limit = keeper.budget.limit
            foreign.send(12)  # 24 stores between two polls: more than any head survives
            keeper.step()
    finally:
        foreign.close()
    s = keeper.summary
    assert s.bursts == 1 and keeper.history[-1].verdict == "cold"
    said = f"up to {s.burst_landed:g} stores landed between two polls; a head survives {limit:g}"
    assert said in str(s) and "only more cache entries" in str(s)
    assert s.burst_landed >= limit


def test_a_miss_from_a_budget_too_large_is_no_burst(sim: SimServer, tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="loop")
    with Worker(sim.url, timeout=5.0) as kw:
        keeper = KeepAlive(kw, [reg.get("loop")], budget=20)
        keeper.step()
        run_loop(sim.url, reg, keeper, calls=4, every=10)  # a poll after each foreign prompt
    assert keeper.summary.cold - keeper.summary.first_cold >= 1  # a poll could have kept it
    assert keeper.summary.bursts == 0 and "burst" not in str(keeper.summary)


@pytest.mark.parametrize(
    ("verdict", "first", "landed", "unit", "burst"),
    [
        ("cold", False, 8, "stores", True),
        ("partial", False, 6, "prompts", True),
        ("cold", False, 5, "stores", False),  # less than a head survives: a poll could help
        ("cold", True, 80, "stores", False),  # a first warm keeps nothing yet
        ("resumed", False, 80, "stores", False),
        ("unverified", False, 80, "stores", False),
        ("cold", False, None, "stores", False),  # the first poll: nothing counted between
        ("cold", False, 999, "seconds", False),  # time counts no prompts
    ],
)
def test_judge_burst(verdict: str, first: bool, landed: int | None, unit: str, burst: bool) -> None:
    got = judge_burst(verdict, first=first, landed=landed, survives=6, unit=unit)  # type: ignore[arg-type]
    assert got is burst


# -- audit's seconds and curve ----------------------------------------------------------------


def _cold_reply(prompt: int, prompt_ms: float) -> dict[str, object]:
    return {
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 1},
        "timings": {"cache_n": 0, "prompt_n": prompt, "prompt_ms": prompt_ms, "predicted_n": 1},
    }


def test_an_all_cold_batch_saves_0_s_not_a_floats_rounding(tmp_path: Path) -> None:
    # Each call's cold estimate is its own time at the batch's mean rate: the sums differ
    # only by rounding (4.4e-16 s for these numbers).
    prompts, ms = (1800, 625, 591, 604, 2717), (107.364, 804.987, 649.187, 875.233, 680.682)
    calls = zip(prompts, ms, strict=True)
    batch = tmp_path / "calls.jsonl"
    batch.write_bytes(b"\n".join(orjson.dumps(_cold_reply(p, t)) for p, t in calls))
    res = run_cli("audit", str(batch))
    assert res.returncode == 0, res.stderr
    line = next(ln for ln in res.stdout.decode().splitlines() if ln.startswith("caching saved"))
    assert "0 s of prefill" in line and not re.search(r"\de-\d", line), line


def test_the_cumulative_curves_only_rise_and_net_to_the_saving() -> None:
    # A cold call scatters around the cold rate: one faster than its estimate, one slower.
    calls = [
        CallSaving("a", 1000, 0, 1.0, 0.8),
        CallSaving("b", 1000, 0, 1.0, 1.3),
        CallSaving("c", 1000, 900, 1.0, 0.2),
    ]
    s = series(calls)
    assert s.saved == pytest.approx([0.2, 0.2, 1.0]) and s.lost == pytest.approx([0.0, 0.3, 0.3])
    assert s.saved[-1] - s.lost[-1] == pytest.approx(sum(c.cold_s - c.actual_s for c in calls))


# -- exit codes and names ---------------------------------------------------------------------


def test_exit_130_on_ctrl_c_is_in_the_readme_table_and_the_code_table() -> None:
    assert int(ExitCode.INTERRUPTED) == 130
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Exit codes", 1)[1].split("\n\n", 2)[1]
    assert re.search(r"^\| 130 \| interrupted \(Ctrl-C", table, re.MULTILINE), table


def test_a_mistyped_name_gets_the_closest_names_in_its_one_line(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add("the coding loop\n", name="coding-loop")
    reg.add("the review loop\n", name="review-loop")
    reg.add("unrelated\n", name="zz")
    res = run_cli("cat", "coding-lop", "--registry", str(reg.root))
    assert res.returncode == int(ExitCode.USAGE)
    err = [ln for ln in res.stderr.decode().splitlines() if ln]
    assert err == ["error: no prefix or frame named 'coding-lop'; did you mean 'coding-loop'?"]
    far = run_cli("cat", "qqqqqq", "--registry", str(reg.root))
    assert far.returncode == 2 and b"did you mean" not in far.stderr

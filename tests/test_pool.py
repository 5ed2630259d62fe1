"""A pool without the router or a real engine: pool files, capacity, placement, the kept
placement file, and `pool warm` / `worker_for` against two loopback simulators."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.pool.live import Pool, served_by
from prefixreg.verbs.pool.spec import (
    ROUTING_KEY_HEADER,
    WORKERS_ENV,
    Assignment,
    PoolSpec,
    WorkerSpec,
    capacity_of,
    load_placement,
    parse_pool_file,
    place,
    pool_spec,
    routing_key,
    save_placement,
)
from prefixreg.verbs.pool.warm import doctor_pool, warm_pool
from tests.conftest import run_cli

A, B, C, D, E = (c * 64 for c in "abcde")


# ---------------------------------------------------------------- pool files and sources


def test_a_toml_pool_file_gives_workers_caps_router_and_a_sibling_placement_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(
        'router = "http://127.0.0.1:30000/"\n'
        '[[workers]]\nurl = "http://127.0.0.1:8080"\ncapacity = 1\n'
        '[[workers]]\nurl = "http://127.0.0.1:8081"\n'
    )
    spec = parse_pool_file(path)
    assert spec.router == "http://127.0.0.1:30000"
    assert spec.workers == (
        WorkerSpec("http://127.0.0.1:8080", 1),
        WorkerSpec("http://127.0.0.1:8081", None),
    )
    assert spec.placement_path == tmp_path / "pool.toml.placement.json"


def test_a_json_pool_file_takes_plain_urls_and_names_its_placement_file(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    path.write_bytes(orjson.dumps({"workers": ["http://h:1", "http://h:2"], "placement": "p.json"}))
    spec = parse_pool_file(path)
    assert [w.url for w in spec.workers] == ["http://h:1", "http://h:2"]
    assert spec.router is None and spec.placement_path == tmp_path / "p.json"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "does not parse"),
        (b"[]", "top level"),
        (b'{"workers": []}', "at least one worker"),
        (b'{"workers": ["ftp://h"]}', "http://"),
        (b'{"workers": [{"url": "http://h:1", "capacity": -1}]}', "capacity"),
        (b'{"workers": [{"url": "http://h:1", "capacity": true}]}', "capacity"),
        (b'{"workers": [{"url": "http://h:1", "slots": 2}]}', "unknown worker field"),
        (b'{"workers": ["http://h:1"], "extra": 1}', "unknown field"),
        (b'{"workers": ["http://h:1", "http://h:1/"]}', "listed twice"),
        (b'{"workers": ["http://h:1"], "router": "http://h:1"}', "also listed as a worker"),
    ],
)
def test_a_bad_pool_file_is_a_one_line_usage_error(tmp_path: Path, body: bytes, says: str) -> None:
    path = tmp_path / "pool.json"
    path.write_bytes(body)
    with pytest.raises(UsageError, match=says):
        parse_pool_file(path)


def test_flags_win_over_a_pool_file_which_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    path.write_bytes(orjson.dumps({"workers": ["http://file:1"]}))
    env = {WORKERS_ENV: "http://env:1, http://env:2"}
    assert [w.url for w in pool_spec(["http://flag:1"], pool_file=path, env=env).workers] == [
        "http://flag:1"
    ]
    assert [w.url for w in pool_spec(pool_file=path, env=env).workers] == ["http://file:1"]
    from_env = pool_spec(env=env, router="http://r:9")
    assert [w.url for w in from_env.workers] == ["http://env:1", "http://env:2"]
    assert from_env.router == "http://r:9"
    # Without a pool file the placement lives beside the registry (Pool), one file per pool.
    assert from_env.placement_path is None
    with pytest.raises(UsageError, match="no pool"):
        pool_spec(env={})


# ---------------------------------------------------------------- capacity and placement


def test_capacity_is_slots_capped_by_measured_survival_and_by_the_pool_file() -> None:
    assert capacity_of(2) == 2
    assert capacity_of(None) == 1  # nobody says: one prefix
    assert capacity_of(4, survival=1) == 2  # k prefixes in turn each see k-1 others
    assert capacity_of(4, survival=0) == 1
    assert capacity_of(4, survival=5, cap=3) == 3
    assert capacity_of(2, cap=0) == 0


def test_place_never_exceeds_a_workers_capacity_and_refuses_what_does_not_fit() -> None:
    plan = place([A, B, C, D], {"w1": 2, "w2": 1})
    assert plan.load() == {"w1": 2, "w2": 1}
    assert plan.refused == [D]  # the prefixes listed first win; nothing evicted for D
    assert set(plan.assigned) == {A, B, C}


def test_place_keeps_current_placements_and_moves_only_the_overload() -> None:
    # The router put three on w1 (keeps 2): the last one listed moves; the others stay.
    plan = place([A, B, C], {"w1": 2, "w2": 2}, current={A: "w1", B: "w1", C: "w1"})
    assert plan.assigned == {A: "w1", B: "w1", C: "w2"}
    assert plan.moved == [C] and plan.refused == []
    # A worker gone from the pool: its prefixes are placed again.
    again = place([A, B], {"w2": 2}, current={A: "w1", B: "w2"})
    assert again.assigned == {A: "w2", B: "w2"} and again.moved == [A]


def test_place_spreads_new_prefixes_over_the_worker_with_most_room() -> None:
    plan = place([A, B, C, D], {"w1": 2, "w2": 2})
    assert plan.load() == {"w1": 2, "w2": 2}
    assert plan.assigned[A] != plan.assigned[B]


def test_routing_keys_are_the_sha_then_numbered_rekeys() -> None:
    assert routing_key(A) == A
    assert routing_key(A, 2) == f"{A}.2"


def test_served_by_names_the_one_worker_whose_mark_moved() -> None:
    assert served_by({"w1": (1, 2), "w2": (5,)}, {"w1": (1, 3), "w2": (5,)}) == "w1"
    assert served_by({"w1": (1,), "w2": (5,)}, {"w1": (2,), "w2": (6,)}) is None  # both moved
    assert served_by({"w1": None}, {"w1": None}) is None


def test_the_placement_file_round_trips_and_a_foreign_file_is_refused(tmp_path: Path) -> None:
    spec = PoolSpec((WorkerSpec("http://h:1"),), placement_path=tmp_path / "p.json")
    save_placement(tmp_path / "p.json", spec, [Assignment(A, "http://h:1", f"{A}.1", "b" * 16)])
    assert load_placement(tmp_path / "p.json") == (
        {A: Assignment(A, "http://h:1", f"{A}.1", "b" * 16)},
        [],
    )
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]  # no temp file left
    assert load_placement(tmp_path / "missing.json") == ({}, [])
    (tmp_path / "bad.json").write_bytes(b'{"format": "other"}')
    with pytest.raises(UsageError, match="not a prefixreg placement"):
        load_placement(tmp_path / "bad.json")


# ---------------------------------------------------------------- two loopback workers


@pytest.fixture
def sims() -> Iterator[list[SimServer]]:
    # Room to spare: the pool files below cap each worker at what the test needs.
    config = SimConfig(speed=4000, max_entries=16)
    with SimServer(config) as one, SimServer(config) as two:
        yield [one, two]


def _texts(n: int) -> list[str]:
    return [f"System brief {i}: " + ("ledger harbor quartz violet " * 300) for i in range(n)]


def test_pool_warm_places_within_capacity_proves_each_and_worker_for_finds_it(
    sims: list[SimServer], registry: Registry, tmp_path: Path
) -> None:
    shas = [registry.add(t) for t in _texts(5)]
    pool_file = tmp_path / "pool.json"
    workers = [{"url": s.url, "capacity": 2} for s in sims]
    pool_file.write_bytes(orjson.dumps({"workers": workers}))
    spec = pool_spec(pool_file=pool_file, env={})
    with Pool(spec, registry) as pool:
        report = warm_pool(pool, [registry.head(s) for s in shas[:4]])
        assert report.ok, report.to_dict()
        # /cache max_entries 16 over 2 entries a request: 8; the pool file caps it at 2.
        assert [(w.slots, w.capacity) for w in report.workers] == [(8, 2), (8, 2)]
        assert {url: len(report.held_by(url)) for url in pool.workers} == {s.url: 2 for s in sims}
        for sha in shas[:4]:
            worker = pool.worker_for(sha)
            assert worker.url == pool.placement[sha].worker
            assert pool.headers_for(sha) == {ROUTING_KEY_HEADER: sha}
            _, ev = pool.chat(sha, fresh_tail(), max_tokens=1, temperature=0)
            assert ev.cache_state == "reused"
        fifth = warm_pool(pool, [registry.head(shas[4])])
        assert fifth.refused == [shas[4]] and not fifth.ok
        with pytest.raises(UsageError, match="not placed"):
            pool.worker_for(shas[4])
    # Another process reads the kept placement and proves it again.
    with Pool(spec, registry) as again:
        doc = doctor_pool(again)
        assert doc.ok and not doc.builds_differ
        assert sorted(p.sha256 for p in doc.proofs) == sorted(shas[:4])


def test_pool_cli_warm_doctor_status_and_exit_codes(sims: list[SimServer], tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    for i, text in enumerate(_texts(3)):
        Registry(reg).add(text, name=f"p{i}")
    pool_file = tmp_path / "pool.toml"
    pool_file.write_text(
        f'[[workers]]\nurl = "{sims[0].url}"\ncapacity = 1\n[[workers]]\nurl = "{sims[1].url}"\n'
        "capacity = 1\n"
    )
    common = ("--pool", str(pool_file), "--registry", str(reg))
    res = run_cli("pool", "warm", "p0", "p1", *common, "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["ok"] and out["capacity"] == 2
    assert [len(w["holds"]) for w in out["workers"]] == [1, 1]
    res = run_cli("pool", "warm", "p2", *common)
    assert res.returncode == 1, res.stderr
    assert b"refused" in res.stdout
    res = run_cli("pool", "doctor", *common)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count(b"RESIDENT") == 2 and b"p0" in res.stdout
    res = run_cli("pool", "status", *common, "--json")
    assert res.returncode == 0 and len(orjson.loads(res.stdout)["placement"]) == 2
    res = run_cli("pool", "doctor", "--registry", str(reg))
    assert res.returncode == 2 and b"no pool" in res.stderr


def test_pool_doctor_flags_workers_whose_builds_differ(tmp_path: Path) -> None:
    reg = tmp_path / "reg"
    Registry(reg).init()
    with (
        SimServer(SimConfig(speed=4000, max_entries=8)) as one,
        SimServer(SimConfig(speed=4000, max_entries=16, model="another-model")) as two,
    ):
        res = run_cli(
            "pool", "doctor", "--worker", one.url, "--worker", two.url, "--registry", str(reg)
        )
        assert res.returncode == 1, res.stderr
        assert b"FLAG: the workers run different builds" in res.stdout
        res = run_cli(
            "pool",
            "status",
            "--worker",
            one.url,
            "--worker",
            two.url,
            "--registry",
            str(reg),
            "--json",
        )
        out = orjson.loads(res.stdout)
        assert res.returncode == 0 and out["builds_differ"] is True
        assert [w["capacity"] for w in out["workers"]] == [4, 8]


def test_a_prefix_asked_for_but_never_proven_is_not_ok() -> None:
    from prefixreg.verbs.pool.warm import PoolReport, Proof

    sha_a, sha_b = "a" * 64, "b" * 64

    def proof(sha: str, verdict: str) -> Proof:
        resident = verdict == "resumed"
        return Proof(sha, "http://127.0.0.1:1", sha, verdict, resident, "", 100, 90, "0" * 16)

    # The router's placement of b could not be traced: no proof for it at all.
    report = PoolReport(workers=[], router=None, asked=[sha_a, sha_b])
    report.proofs.append(proof(sha_a, "resumed"))
    oks = [report.ok]
    report.proofs.append(proof(sha_b, "resumed"))
    oks.append(report.ok)
    report.proofs[1] = proof(sha_b, "unverified")
    oks.append(report.ok)
    assert oks == [False, True, False] and report.unverified

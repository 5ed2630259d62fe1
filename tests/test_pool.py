"""A pool without the router or a real engine: pool files, capacity, placement, the kept
placement file, and `pool warm` / `worker_for` against two loopback simulators."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from prefixreg.core.errors import PrefixregError, UsageError
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
    default_placement,
    load_placement,
    lru_heads,
    parse_pool_file,
    place,
    pool_spec,
    routing_key,
    save_placement,
)
from prefixreg.verbs.pool.warm import doctor_pool, warm_pool
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, Request
from tests.test_frames import TOOLS

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
    # Heads sharing one LRU (p entries a call): a measured survival s is (s+1)p entries.
    # Checked in any order (issue 33): 8 entries keep 2 heads, not the 3 of one fixed order.
    assert lru_heads(8, 2) == 2 and lru_heads(16, 2) == 3 and lru_heads(1, 2) == 0
    assert lru_heads(12, 2) == 3 and lru_heads(7, 1) == 3
    assert capacity_of(lru_heads(8, 2), survival=3, per_call=2) == 2
    assert capacity_of(None, survival=3, per_call=1) == 2  # vLLM & co: no size, survival 3
    assert capacity_of(None, per_call=1) == 1  # nothing reported, nothing measured
    assert capacity_of(None, survival=3) == 1  # llama.cpp without total_slots: as before


def _rounds_resume(entries: int, per_call: int, orders: list[list[int]]) -> bool:
    """Whether every call after the first round resumes on the simulator's own LRU."""
    from prefixreg.sim.cache import PromptCache
    from prefixreg.sim.tokenizer import render_chat

    config = SimConfig(max_entries=entries, entries_per_request=per_call, counter_lag=0)
    cache, n = PromptCache(config), 0
    for r, order in enumerate(orders):
        for head in order:
            system = f"head {head} " + "word " * 40
            prompt = render_chat([("system", system), ("user", f"fresh tail {n}")])
            n += 1
            cached = cache.lookup(prompt)
            cache.store(prompt)
            if r > 0 and cached == 0:
                return False
    return True


@pytest.mark.parametrize("per_call", [1, 2])
def test_lru_heads_is_what_the_simulators_own_lru_keeps_checked_in_any_order(
    per_call: int,
) -> None:
    # The simulator's LRU (Flash: every call stores its places, a hit refreshes one): k heads
    # warmed in one order, then checked round after round, each round in another order
    # (reversed, rotated, shuffled): all resume exactly when k fits.
    import random

    rng = random.Random(33)
    for entries in range(17):
        kept = []
        for k in range(1, 9):
            heads = list(range(k))
            orders = [heads, heads[::-1], heads, heads[1:] + heads[:1], heads[::-1]]
            orders += [rng.sample(heads, k) for _ in range(6)]
            if _rounds_resume(entries, per_call, orders):
                kept.append(k)
        assert max(kept, default=0) == lru_heads(entries, per_call), (entries, kept)
        survival = (entries - per_call) // per_call if entries >= per_call else None
        if survival is not None:  # what a probe measures never claims more than the LRU keeps
            assert capacity_of(None, survival, per_call=per_call) <= lru_heads(entries, per_call)


def test_place_never_exceeds_a_workers_capacity_and_refuses_what_does_not_fit() -> None:
    plan = place([A, B, C, D], {"w1": 2, "w2": 1})
    assert Counter(plan.assigned.values()) == {"w1": 2, "w2": 1}
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
    assert Counter(plan.assigned.values()) == {"w1": 2, "w2": 2}
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
        # /cache max_entries 16 at 2 entries a call: 3 heads in any order; capped at 2 here.
        assert [(w.slots, w.capacity) for w in report.workers] == [(3, 2), (3, 2)]
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
    # The same workers given by --worker keep their own placement: none yet, and it says so.
    workers = ("--worker", sims[0].url, "--worker", sims[1].url, "--registry", str(reg))
    res = run_cli("pool", "doctor", *workers)
    assert res.returncode == 0 and b"RESIDENT" not in res.stdout, res.stdout + res.stderr
    assert b"no head is placed on this pool" in res.stdout + res.stderr


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
        # 8 and 16 entries at 2 a call (each call also refreshes one): 2 and 3 heads.
        assert [w["capacity"] for w in out["workers"]] == [2, 3]


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


# ---------------------------------------------------------------- issue 20: resident means resident


def _brief(i: int) -> str:
    return f"System brief q{i}: " + "ledger harbor quartz violet meadow copper " * 400


def _names_out_of_sha_order(reg: Path, n: int) -> list[str]:
    """Register n briefs; their names listed in descending sha order (a proof run's own
    order is ascending: listing them so shows a run that proves in the order it was asked)."""
    shas = {Registry(reg).add(_brief(i), name=f"q{i}"): f"q{i}" for i in range(n)}
    return [shas[sha] for sha in sorted(shas, reverse=True)]


@pytest.mark.parametrize(
    ("n", "probe", "asked"), [(2, False, "sha"), (3, False, "user"), (4, True, "sha")]
)
def test_pool_warm_on_the_default_simulator_keeps_what_survives_checks_in_any_order(
    n: int, probe: bool, asked: str, tmp_path: Path
) -> None:
    # The default simulator (8-entry LRU, 2 entries a call, a hit refreshes one; only faster)
    # keeps 3 heads used in one fixed order but 2 checked in any order. Before (issue 33):
    # `pool warm q0 q1 q2` said three RESIDENT (exit 0), and the user's own first round of
    # checks, q0 q1 q2, found q1 cold: capacity held only for the proofs' order (by sha).
    reg = str(tmp_path / "reg")
    by_sha = _names_out_of_sha_order(tmp_path / "reg", n)
    names = sorted(by_sha) if asked == "user" else by_sha  # q0 q1 q2: the user's own order
    with SimServer(SimConfig(speed=8000)) as sim:
        where = ("--worker", sim.url, "--registry", reg)
        if probe:  # the review's case: a survival probe (3) on this build first
            assert run_cli("probe", "--sizes", "4k", "--survival", *where).returncode == 0
        res = run_cli("pool", "warm", *names, *where, "--json")
        out = orjson.loads(res.stdout)
        doctor = run_cli("pool", "doctor", *where, "--json")
        held = {h["sha256"] for h in out["workers"][0]["holds"]}
        placed = [m for m in names if Registry(reg).resolve(m) in held]
        # The user's rounds: in their order, reversed, by sha, and theirs again.
        rounds = [placed, placed[::-1], [m for m in by_sha[::-1] if m in placed], placed]
        after = [
            (name, run_cli("warm", name, "--check-only", *where).returncode)
            for order in rounds
            for name in order
        ]
    assert [code for _, code in after] == [0] * len(after), after  # every check resumed
    holds, kept = out["workers"][0]["holds"], min(n, 2)
    assert out["capacity"] == 2 and out["workers"][0]["survival"] == (3 if probe else None)
    assert len(holds) == kept and all(h["resident"] for h in holds), holds
    if n <= 2:
        assert res.returncode == 0 and out["ok"], res.stderr
    else:  # the rest is refused before anything is sent: it evicts none of the two
        assert res.returncode == 1 and len(out["refused"]) == n - 2, res.stdout
        assert placed == names[:2]  # the heads listed first win
        assert out["refused"] == [Registry(reg).resolve(m) for m in names[2:]]
    # The doctor's own checks, straight after, evict none of them.
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    proven = orjson.loads(doctor.stdout)["workers"][0]["holds"]
    assert len(proven) == kept and all(h["resident"] for h in proven), proven


@pytest.mark.parametrize("probe", [False, True])
def test_an_engine_without_slots_or_cache_keeps_heads_by_its_measured_survival(
    probe: bool, tmp_path: Path
) -> None:
    # vLLM has neither /slots nor /cache: 1 head, or with a survival probe (3 on the
    # simulator) 1 + 3 // 2 = 2 (another head's call costs at most two foreign prompts).
    reg = str(tmp_path / "reg")
    names = _names_out_of_sha_order(tmp_path / "reg", 3)
    with SimServer(SimConfig(speed=8000, engine="vllm")) as sim:
        where = ("--worker", sim.url, "--registry", reg)
        if probe:
            assert run_cli("probe", "--sizes", "4k", "--survival", *where).returncode == 0
        res = run_cli("pool", "warm", *names, *where, "--json")
        out = orjson.loads(res.stdout)
        doctor = run_cli("pool", "doctor", *where, "--json")
    kept = 2 if probe else 1
    assert res.returncode == 1 and out["capacity"] == kept, res.stdout
    assert out["workers"][0]["survival"] == (3 if probe else None)
    holds = out["workers"][0]["holds"]
    assert len(holds) == kept and all(h["resident"] for h in holds), holds
    assert len(out["refused"]) == 3 - kept
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    proven = orjson.loads(doctor.stdout)["workers"][0]["holds"]
    assert len(proven) == kept and all(h["resident"] for h in proven), proven


def _one_slot_llamacpp(srv: FakeServer) -> None:
    """A llama.cpp-shaped server whose /props says 3 slots but whose cache holds 1 prompt."""
    held: list[object] = [None]
    props = {
        "build_info": "b1-liar",
        "model_path": "/m.gguf",
        "total_slots": 3,
        "default_generation_settings": {"n_ctx": 65536},
        "chat_template": "{{ messages }}",
    }
    srv.route("GET", "/health", Reply(json={"status": "ok"}))
    srv.route("GET", "/props", Reply(json=props))
    srv.route("GET", "/slots", Reply(status=501, json={"error": {"message": "no slots"}}))

    def chat(req: Request) -> Reply:
        system, tail = (m["content"] for m in req.json["messages"])
        head = len(system) // 4
        prompt = head + len(tail) // 4 + 8
        cached = head if held[0] == system else 0
        held[0] = system
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
        usage["prompt_tokens_details"] = {"cached_tokens": cached}  # type: ignore[assignment]
        msg = {"index": 0, "message": {"role": "assistant", "content": "ok"}}
        return Reply(json={"choices": [msg], "usage": usage})

    srv.route("POST", "/v1/chat/completions", chat)


def test_a_server_whose_props_promise_three_slots_but_hold_one_is_not_called_ok(
    tmp_path: Path,
) -> None:
    reg = Registry(tmp_path / "reg")
    heads = [reg.head(reg.add(_brief(i))) for i in range(3)]
    with FakeServer() as srv:
        _one_slot_llamacpp(srv)
        spec = pool_spec([srv.url], env={})
        with Pool(spec, reg) as pool:
            report = warm_pool(pool, heads)
            assert [w.capacity for w in report.workers] == [3]
            assert not report.ok and not any(p.resident for p in report.proofs)
            assert pool.placement == {}  # only resident heads are kept
        one = warm_pool(Pool(spec, reg), heads[:1])  # one head fits: its second check resumes
    assert one.ok and [p.resident for p in one.proofs] == [True]


# ---------------------------------------------------------------- issue 20: one worker identity


def test_two_spellings_of_one_worker_are_refused_everywhere_and_nothing_is_sent(
    tmp_path: Path,
) -> None:
    reg = str(tmp_path / "reg")
    Registry(tmp_path / "reg").add(_brief(0), name="q0")
    with SimServer(SimConfig(speed=8000)) as sim:
        port = sim.url.rsplit(":", 1)[1]
        twins = [
            f"{sim.url}/v1",
            f"{sim.url}/v1/",
            f"http://localhost:{port}",
            f"http://127.0.0.1:0{port}",
            f"HTTP://127.0.0.1:{port}/",
        ]
        for twin in twins:
            res = run_cli(
                "pool", "warm", "q0", "--worker", sim.url, "--worker", twin, "--registry", reg
            )
            assert res.returncode == 2 and b"listed twice" in res.stderr, (twin, res.stderr)
            env = {WORKERS_ENV: f"{sim.url},{twin}"}
            res = run_cli("pool", "status", "--registry", reg, env=env)
            assert res.returncode == 2 and b"listed twice" in res.stderr, (twin, res.stderr)
            path = tmp_path / "pool.json"
            path.write_bytes(orjson.dumps({"workers": [sim.url, {"url": twin, "capacity": 1}]}))
            with pytest.raises(UsageError, match="listed twice"):
                parse_pool_file(path)
        res = run_cli(
            "pool", "status", "--worker", sim.url, "--router", f"http://localhost:{port}/v1"
        )
        assert res.returncode == 2 and b"also listed as a worker" in res.stderr
        assert sim.requests() == []
    # Distinct workers stay distinct: another port, another path, another scheme.
    spec = pool_spec(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:1/x"])
    assert [w.url for w in spec.workers][2] == "http://127.0.0.1:1/x"
    assert pool_spec(["https://127.0.0.1:1", "http://127.0.0.1:1"], env={}).pool_id


# ---------------------------------------------------------------- issue 33: one spelling per worker


def test_other_spellings_of_one_worker_are_one_worker_in_every_source(tmp_path: Path) -> None:
    # Before: these four spellings of one simulator each counted as another worker, so six
    # heads on a simulator that keeps three were all "RESIDENT" (exit 0), then one resumed.
    reg = str(tmp_path / "reg")
    names = [f"q{i}" for i in range(6)]
    for i, name in enumerate(names):
        Registry(tmp_path / "reg").add(_brief(i), name=name)
    with SimServer(SimConfig(speed=8000)) as sim:
        port = sim.url.rsplit(":", 1)[1]
        twins = [f"http://[::ffff:127.0.0.1]:{port}", f"{sim.url}/.", f"{sim.url}/v1/./"]
        twins += [f"{sim.url}/x/..", f"http://localhost.:{port}"]
        for twin in twins:
            res = run_cli("pool", "warm", *names, "--worker", sim.url, "--worker", twin)
            assert res.returncode == 2 and b"listed twice" in res.stderr, (twin, res.stderr)
            res = run_cli(
                "pool", "status", "--registry", reg, env={WORKERS_ENV: f"{sim.url},{twin}"}
            )
            assert res.returncode == 2 and b"listed twice" in res.stderr, (twin, res.stderr)
            path = tmp_path / "pool.toml"
            path.write_text(f'[[workers]]\nurl = "{sim.url}"\n[[workers]]\nurl = "{twin}"\n')
            res = run_cli("pool", "warm", *names, "--pool", str(path), "--registry", reg)
            assert res.returncode == 2 and b"listed twice" in res.stderr, (twin, res.stderr)
            res = run_cli("pool", "status", "--worker", sim.url, "--router", twin)
            assert res.returncode == 2 and b"also listed as a worker" in res.stderr
        assert sim.requests() == []
    one = pool_spec([f"http://[::ffff:127.0.0.1]:{port}/v1/."], env={})
    assert [w.url for w in one.workers] == [f"http://127.0.0.1:{port}"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://0.0.0.0:{port}", b"the address a server listens on"),
        ("http://[::]:{port}", b"the address a server listens on"),
        ("http://[::ffff:0.0.0.0]:{port}", b"the address a server listens on"),
        ("http://127.0.0.1:{port}/?a=1", b"query or fragment"),
        ("http://127.0.0.1:{port}?", b"query or fragment"),
        ("http://127.0.0.1:{port}#top", b"query or fragment"),
        ("http://127.0.0.1\r\n:{port}", b"control character"),
        ("http://127.0.0.1\n:{port}", b"control character"),
        ("http://127.0.0 .1:{port}", b"a space"),
        ("http://127.0.0.1\t:{port}", b"control character"),
    ],
)
def test_a_worker_url_that_is_no_worker_address_is_refused_at_every_door(
    url: str, says: bytes, tmp_path: Path
) -> None:
    reg = str(tmp_path / "reg")
    Registry(tmp_path / "reg").add(_brief(0), name="q0")
    with SimServer(SimConfig(speed=8000)) as sim:
        bad = url.format(port=sim.url.rsplit(":", 1)[1])
        runs = [
            run_cli("pool", "warm", "q0", "--worker", bad, "--registry", reg),
            run_cli("pool", "status", "--registry", reg, env={WORKERS_ENV: bad}),
            run_cli("pool", "status", "--worker", sim.url, "--router", bad, "--registry", reg),
            run_cli("warm", "q0", "--worker", bad, "--registry", reg),
        ]
        path = tmp_path / "pool.json"
        path.write_bytes(orjson.dumps({"workers": [bad]}))
        runs.append(run_cli("pool", "warm", "q0", "--pool", str(path), "--registry", reg))
        for res in runs:
            assert res.returncode == 2 and says in res.stderr, (bad, res.stderr)
            assert b"Traceback" not in res.stderr
        with pytest.raises(UsageError, match=says.decode()):
            WorkerSpec(bad)
        assert sim.requests() == []
    if b"listens" in says:
        assert b"http://127.0.0.1:PORT" in runs[0].stderr  # the spelling to use instead


@pytest.mark.parametrize(
    ("value", "says"),
    [(" , ,", "blank entry"), ("http://127.0.0.1:1,,http://127.0.0.1:2", "blank entry")],
)
def test_a_blank_worker_list_is_refused(value: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=says):
        pool_spec(env={WORKERS_ENV: value})
    res = run_cli("pool", "status", "--registry", str(tmp_path / "reg"), env={WORKERS_ENV: value})
    assert res.returncode == 2 and says.encode() in res.stderr


def test_user_info_in_a_worker_url_is_refused_never_written_to_the_placement() -> None:
    with pytest.raises(UsageError, match="no user info"):
        WorkerSpec("http://alice:secret@127.0.0.1:1")


# ---------------------------------------------------------------- issue 21: heads, one state rule


def test_pool_warm_takes_a_frame_and_keeps_its_placement_beside_the_registry(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home-reg"
    reg = Registry(home)
    reg.add(_brief(0), name="system")
    reg.add_frame("system", tools=json.dumps(TOOLS), settings={"tool_choice": "auto"}, name="loop")
    frame = reg.head("loop")
    with SimServer(SimConfig(speed=8000)) as sim:
        env = {"PREFIXREG_HOME": str(home)}
        res = run_cli("pool", "warm", "loop", "--worker", sim.url, "--json", env=env)
        assert res.returncode == 0, res.stderr
        (held,) = orjson.loads(res.stdout)["workers"][0]["holds"]
        assert held["sha256"] == frame.sha256 and held["resident"]
        spec = pool_spec([sim.url], env={})
        placement = tmp_path / "home-reg.pools" / f"{spec.pool_id}.json"
        assert [p.name for p in placement.parent.iterdir()] == [placement.name]  # no temp
        with Pool(spec, reg) as pool:
            assert pool.placement_path == placement and list(pool.placement) == [frame.sha256]
            _, ev = pool.chat(frame, fresh_tail(), max_tokens=1)
            assert ev.cache_state == "reused" and pool.worker_for("loop").url == sim.url
    assert not (tmp_path / "xdg-state").exists()  # not the pool's own state directory


# ---------------------------------------------------------------- issue 22: stale and corrupt state


def test_a_placement_naming_a_pruned_head_or_a_corrupt_entry_is_dropped_with_a_warning(
    tmp_path: Path,
) -> None:
    root = tmp_path / "reg"
    reg = Registry(root)
    kept = reg.add(_brief(0), name="q0")
    gone = reg.add(_brief(1))
    with SimServer(SimConfig(speed=8000)) as sim:
        common = ("--worker", sim.url, "--registry", str(root))
        assert run_cli("pool", "warm", "q0", gone, *common).returncode == 0
        # What `gc --prune-unnamed` does to an unnamed object (once its measurements age).
        reg.object_path(gone).unlink()
        (reg.root / "meta" / f"{gone}.json").unlink()
        path = default_placement(root, pool_spec([sim.url], env={}).pool_id)
        body = orjson.loads(path.read_bytes())
        assert {e["sha256"] for e in body["entries"]} == {kept, gone}
        body["entries"] += [{"sha256": "zz"}, 7, {"sha256": kept[:12], "worker": sim.url}]
        path.write_bytes(orjson.dumps(body))
        res = run_cli("pool", "warm", "q0", *common, "--json")
        assert res.returncode == 0, res.stderr
        warnings = orjson.loads(res.stdout)["warnings"]
        assert len(warnings) == 4 and any(gone[:12] in w for w in warnings), warnings
        assert res.stderr.count(b"warning:") == 4
        after = orjson.loads(path.read_bytes())["entries"]
        assert [e["sha256"] for e in after] == [kept]  # rewritten without them
    path.write_bytes(b'{"format": "not ours"}')
    with pytest.raises(UsageError, match="not a prefixreg placement"):
        Pool(pool_spec([sim.url], env={}), reg)
    assert path.read_bytes() == b'{"format": "not ours"}'  # never overwritten


@pytest.mark.parametrize("kind", ["fifo", "dir", "big"])
def test_a_pool_file_that_is_not_a_small_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.write_bytes(b" " * (2 << 20))
    res = run_cli("pool", "status", "--pool", str(path), "--registry", str(tmp_path / "reg"))
    assert res.returncode == 2 and b"Traceback" not in res.stderr, res.stderr


# ---------------------------------------------------------------- issue 22: a typed boundary


def test_the_pool_api_refuses_wrong_types_and_values_with_its_own_errors(
    registry: Registry, tmp_path: Path
) -> None:
    spec = pool_spec(["http://127.0.0.1:1"], env={})
    bad: list[Callable[[], object]] = [
        lambda: WorkerSpec(123),  # type: ignore[arg-type]
        lambda: WorkerSpec("http://127.0.0.1:1", capacity="2"),  # type: ignore[arg-type]
        lambda: WorkerSpec("http://127.0.0.1:0"),
        lambda: WorkerSpec("http://127.0.0.1:99999"),
        lambda: PoolSpec(()),
        lambda: PoolSpec("http://127.0.0.1:1"),  # type: ignore[arg-type]
        lambda: PoolSpec((WorkerSpec("http://127.0.0.1:1"),), placement_path="p"),  # type: ignore[arg-type]
        lambda: Pool(spec, "reg"),  # type: ignore[arg-type]
        lambda: Pool(None, registry),  # type: ignore[arg-type]
        lambda: Pool(spec, registry, timeout=math.nan),
        lambda: Pool(spec, registry, read_timeout=-1),
        lambda: pool_spec([123], env={}),  # type: ignore[list-item]
        lambda: pool_spec("http://127.0.0.1:1", env={}),
        lambda: pool_spec(123, env={}),  # type: ignore[arg-type]
        lambda: parse_pool_file(123),  # type: ignore[arg-type]
        lambda: doctor_pool("pool"),  # type: ignore[arg-type]
        lambda: warm_pool("pool", []),  # type: ignore[arg-type]
    ]
    for call in bad:
        with pytest.raises(PrefixregError):
            call()
    with Pool(spec, registry) as pool:
        for wrong in ("nope", 123, None, b"x"):
            with pytest.raises(PrefixregError):
                pool.worker_for(wrong)  # type: ignore[arg-type]
        for heads in ("q0", [registry.add("x" * 300)], None):
            with pytest.raises(PrefixregError):
                warm_pool(pool, heads)  # type: ignore[arg-type]


def test_pool_status_exits_5_when_a_worker_does_not_answer(tmp_path: Path) -> None:
    # Before (issue 33): exit 0 with every worker unreachable.
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])  # closed again: nothing listens there
    reg = str(tmp_path / "reg")
    Registry(tmp_path / "reg").init()
    gone = [arg for p in ports for arg in ("--worker", f"http://127.0.0.1:{p}")]
    res = run_cli("pool", "status", *gone, "--registry", reg, "--json")
    assert res.returncode == 5, (res.stdout, res.stderr)
    out = orjson.loads(res.stdout)  # the report is printed all the same
    assert [w["error"] is not None for w in out["workers"]] == [True, True]
    assert b"2 of 2 workers did not answer" in res.stderr
    with SimServer(SimConfig(speed=8000)) as sim:
        one_up = run_cli("pool", "status", "--worker", sim.url, *gone[:2], "--registry", reg)
        both_up = run_cli("pool", "status", "--worker", sim.url, "--registry", reg)
    assert one_up.returncode == 5 and b"UNREACHABLE" in one_up.stdout, one_up.stderr
    assert b"1 of 2 workers did not answer" in one_up.stderr
    assert both_up.returncode == 0, both_up.stderr

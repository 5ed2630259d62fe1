"""`audit`: what caching saved (the counterfactual), where the uncached tokens went, the lever
verdict from that split on every engine, and the batch's wall time from aiperf's exports.

The counterfactual is checked against the simulator's lane, whose cold and resumed prefill
times are its published model (`SimConfig.prefill_s`): the expected seconds are computed from
the model here, not read from the code under test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.levers import judge_lever
from prefixreg.core.prefix import fresh_tail
from prefixreg.registry.store import Registry
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.audit.run import run_audit
from tests.conftest import run_cli
from tests.hypothesis_profile import bounded

FIXTURES = Path(__file__).parent / "fixtures" / "aiperf"
SYSTEM = "You are the build bot. Answer with one word and keep the house style.\n" * 40


def chat(system: str, tail: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": tail}]
    return {"messages": messages, "max_tokens": 1, "temperature": 0, **extra}


def run_batch(profile: str, tails: list[str], out: Path, speed: float = 40.0) -> SimConfig:
    """Send `tails` after SYSTEM to a simulator; write the {request, response} pairs."""
    config = SimConfig.for_profile(profile, speed=speed)
    lines = []
    with SimServer(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        for tail in tails:
            body = chat(SYSTEM, tail)
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            lines.append(orjson.dumps({"request": body, "response": resp.json()}))
    out.write_bytes(b"\n".join(lines) + b"\n")
    return config


def audit_json(*args: str) -> dict[str, Any]:
    res = run_cli("audit", *args, "--json")
    assert res.returncode == 0, res.stderr
    out: dict[str, Any] = orjson.loads(res.stdout)
    return out


def usage_of(pair: dict[str, Any]) -> tuple[int, int]:
    usage = pair["response"]["usage"]
    return usage["prompt_tokens"], usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


# --------------------------------------------------------------------------------------
# Acceptance: the counterfactual against a batch whose cold and resumed times are known.


def test_counterfactual_matches_the_lanes_known_cold_and_resumed_times(tmp_path: Path) -> None:
    path = tmp_path / "batch.jsonl"
    tails = [fresh_tail() for _ in range(5)]  # one cold call, then four fresh tails resumed
    config = run_batch("flash", tails, path)
    pairs = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    counts = [usage_of(p) for p in pairs]
    assert counts[0][1] == 0 and all(c > 0 for _, c in counts[1:])
    cold = [config.prefill_s(prompt=p, cached=0) / config.speed for p, _ in counts]
    served = [config.prefill_s(prompt=p, cached=c) / config.speed for p, c in counts]

    s = audit_json(str(path))["saving"]
    assert s["calls"] == 5
    assert s["tokens"] == {"cold": sum(p for p, _ in counts), "saved": sum(c for _, c in counts)}
    # The server's timings: what it took (to the 3 decimals of prompt_ms), and cold at the
    # server's own rate on the batch's one cold prefill.
    assert s["cold_rate"]["calls"] == 1
    assert s["seconds"]["actual"] == pytest.approx(sum(served), abs=5 * 1e-6)
    assert s["seconds"]["cold"] == pytest.approx(sum(cold), rel=0.01)
    assert s["seconds"]["saved"] == pytest.approx(sum(cold) - sum(served), rel=0.01)
    # Four fresh tails: their uncached tokens are new history; the cold call missed the head.
    u = s["uncached"]
    assert u["unknown"] == 0 and u["drift"] == 0
    assert u["miss"] + u["new_history"] == sum(p - c for p, c in counts)
    assert u["new_history"] >= sum(p - c for p, c in counts[1:])
    assert s["lever"]["verdict"] == "lever"  # the cold call's head dwarfs the short tails


def test_without_timings_the_counterfactual_uses_the_rate() -> None:
    s = audit_json(str(FIXTURES / "profile_export.jsonl"), "--prefill-tps", "500")["saving"]
    assert s["cold_rate"] == {"tokens_per_s": None, "calls": 0}
    assert s["tokens"] == {"cold": 5116, "saved": 3408}
    assert s["seconds"]["cold"] == pytest.approx(5116 / 500)
    assert s["seconds"]["saved"] == pytest.approx(3408 / 500)
    # Responses read without their requests: no head to split by, so no verdict on the lever.
    assert s["uncached"]["unknown"] == 5116 - 3408 and s["lever"]["verdict"] == "unverified"


# --------------------------------------------------------------------------------------
# The lever: one rule, from the uncached split, whatever the engine reports of time.


def response(prompt: int, cached: int, timings: dict[str, float] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": 40,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    return out | ({"timings": timings} if timings else {})


@pytest.mark.parametrize("history", [20, 4000])
def test_the_lever_is_the_same_for_two_engines_given_the_same_split(
    tmp_path: Path, history: int
) -> None:
    """llama-server (timings: a fast prefill, decode dominates) and a server without timings
    at a slow rate (prefill dominates): the same tokens, the same lever verdict."""
    rows = [(3000 + history, 0), (3000 + 2 * history, 3000 + history)]  # cold, then resumed
    verdicts, dominant = [], []
    for engine, timings in (("llama", {"prompt_ms": 5.0, "predicted_ms": 900.0}), ("sim", None)):
        path = tmp_path / f"{engine}.jsonl"
        pairs = [
            {"request": chat(SYSTEM, "x" * (8 * history)), "response": response(p, c, timings)}
            for p, c in rows
        ]
        path.write_bytes(b"\n".join(orjson.dumps(p) for p in pairs))
        out = audit_json(str(path), "--prefill-tps", "50")
        verdicts.append((out["saving"]["uncached"], out["saving"]["lever"]))
        dominant.append(out["time"]["dominant"])
        assert out["summary"].endswith(out["saving"]["lever"]["reason"])
    assert dominant == ["decode", "prefill"]
    assert verdicts[0] == verdicts[1]
    expected = "lever" if history == 20 else "not_lever"
    assert verdicts[0][1]["verdict"] == expected


def test_drift_is_named_by_the_frame(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(SYSTEM, name="sys")
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {}}}]
    sha = reg.add_frame("sys", tools=orjson.dumps(tools), name="loop")
    other = [{"type": "function", "function": {"name": "rm", "parameters": {}}}]
    pairs = [
        {"request": chat(SYSTEM, "a", tools=tools), "response": response(900, 880, None)},
        {"request": chat(SYSTEM, "b", tools=other), "response": response(900, 100, None)},
    ]
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(p) for p in pairs))
    report = run_audit([path], registry=reg, frame=reg.head(sha))
    s: Any = report.to_dict()["saving"]
    assert s["uncached"]["drift"] > 0 and s["drift_parts"] == {"tools": s["uncached"]["drift"]}
    assert s["uncached"]["drift"] + s["uncached"]["new_history"] + s["uncached"]["miss"] == 820
    assert "drift " in report.to_text() and " (tools " in report.to_text()


def test_without_a_frame_a_call_off_the_batchs_prefix_is_drift_not_a_miss(
    tmp_path: Path,
) -> None:
    """No --frame: the batch's first message is the head; a call whose first message is
    another is drift of its `system` part, never a miss of the head."""
    other = SYSTEM.replace("build bot", "test bot")
    pairs = [
        {"request": chat(SYSTEM, "a"), "response": response(900, 899, None)},
        {"request": chat(SYSTEM, "b"), "response": response(900, 899, None)},
        {"request": chat(other, "c"), "response": response(900, 0, None)},
    ]
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(p) for p in pairs))
    s = audit_json(str(path), "--prefill-tps", "500")["saving"]
    u = s["uncached"]
    assert u["miss"] == 0 and u["drift"] > 0 and s["drift_parts"] == {"system": u["drift"]}
    assert u["drift"] + u["new_history"] == 1 + 1 + 900
    assert b"(system " in run_cli("audit", str(path), "--prefill-tps", "500").stdout


counts = st.integers(min_value=0, max_value=10**9)


@bounded(300)
@given(counts, counts, counts, counts, counts, st.integers(min_value=1, max_value=1000))
def test_judge_lever_depends_on_the_split_alone(
    cached: int, history: int, drift: int, miss: int, unknown: int, k: int
) -> None:
    verdict, _ = judge_lever(
        cached=cached, new_history=history, drift=drift, miss=miss, unknown=unknown
    )
    scaled, _ = judge_lever(
        cached=k * cached,
        new_history=k * history,
        drift=k * drift,
        miss=k * miss,
        unknown=k * unknown,
    )
    assert verdict == scaled  # a share, not a size
    if verdict == "lever":
        assert drift + miss >= history and drift + miss > 0
        more, _ = judge_lever(
            cached=cached, new_history=history, drift=drift, miss=miss + 1, unknown=unknown
        )
        assert more == "lever"
    if verdict == "not_lever":
        assert history > drift + miss or history + drift + miss + unknown == 0
    # Drift and misses are one kind: moving tokens between them never changes the verdict.
    moved, _ = judge_lever(
        cached=cached, new_history=history, drift=0, miss=drift + miss, unknown=unknown
    )
    assert moved == verdict


# --------------------------------------------------------------------------------------
# aiperf's exports: the batch's span and concurrency, the server's counts, each request once.


def test_aiperf_exports_give_the_batchs_span_and_concurrency() -> None:
    for files in (["profile_export.jsonl"], ["profile_export_raw.jsonl"], ["."]):
        out = audit_json(*(str(FIXTURES / f) for f in files))
        t = out["time"]
        assert out["calls"] == 5 and out["malformed"] == []
        # Without the requests (the records export) a cached count has no head to cover.
        reused = 0 if files == ["profile_export.jsonl"] else 3
        assert out["states"] == {
            "reused": reused,
            "partial": 0,
            "cold": 1,
            "unverified": 4 - reused,
        }
        assert t["span_s"] == pytest.approx(0.6025) and t["wall_s"] == pytest.approx(0.6025)
        assert (t["span_calls"], t["concurrency_peak"]) == (5, 2)
        assert t["concurrency_mean"] == pytest.approx(1.04275 / 0.6025)
        assert t["summed_s"] == pytest.approx(1.04275)
        assert out["tokens"]["prompt"]["total"] == 5116
        assert out["tokens"]["cached"]["total"] == 3408
        assert round(out["cached_share"] * 100, 2) == 66.61  # aiperf's own cache read %
        assert out["unverified"][-1]["reason"] == "aiperf: the request failed (HTTP 500)"
    both = audit_json(str(FIXTURES))
    assert len(both["skipped"]) == 5  # the records file's lines: read from the raw export
    assert all("profile_export.jsonl" in s["source"] for s in both["skipped"])
    # The raw export carries the requests: the system prefix is named by byte identity.
    assert both["system_prefix"]["identical"] == 5


def test_aiperf_requests_without_an_id_count_once_from_both_exports(tmp_path: Path) -> None:
    for name in ("profile_export.jsonl", "profile_export_raw.jsonl"):
        records = [orjson.loads(x) for x in (FIXTURES / name).read_bytes().splitlines()]
        for r in records:
            r["metadata"]["x_request_id"] = None
        (tmp_path / name).write_bytes(b"\n".join(orjson.dumps(r) for r in records))
    out = audit_json(str(tmp_path))
    assert out["calls"] == 5 and len(out["skipped"]) == 5
    assert out["tokens"]["prompt"]["total"] == 5116 and out["time"]["concurrency_peak"] == 2


def test_aiperf_older_nulls_warmup_and_a_missing_cache_count(tmp_path: Path) -> None:
    lines = (FIXTURES / "profile_export.jsonl").read_bytes().splitlines()
    first, second, third = (orjson.loads(line) for line in lines[:3])
    first["error"] = None  # older aiperf: "error": null on a success
    first["metadata"]["cancellation_time_ns"] = None
    second["metadata"]["benchmark_phase"] = "warmup"
    del third["metrics"]["usage_prompt_cache_read_tokens"]  # the server reported none
    path = tmp_path / "profile_export.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in (first, second, third)))
    out = audit_json(str(path))
    assert out["calls"] == 2 and out["states"]["cold"] == 1 and out["states"]["unverified"] == 1
    assert "cached_tokens missing" in out["unverified"][0]["reason"]
    assert "warm-up" in out["skipped"][0]["reason"]
    assert out["tokens"]["cached"] == {"total": 0, "mean": 0.0, "calls": 1}
    text = run_cli("audit", str(FIXTURES / "profile_export.jsonl")).stdout.decode()
    assert "the batch's span over 5 calls (concurrency peak 2, mean 1.73" in text


def test_hostile_aiperf_records_are_unverified_calls_never_a_crash(tmp_path: Path) -> None:
    raw = orjson.loads((FIXTURES / "profile_export_raw.jsonl").read_bytes().splitlines()[0])
    meta = raw["metadata"]
    bad: list[dict[str, Any]] = [
        {**raw, "responses": [{"perf_ns": 1, "packets": 5}]},  # packets not a list
        {**raw, "responses": "data: {}"},  # responses not a list
        {**raw, "responses": [7, None, {"packets": [{"name": "data", "value": "{not json"}]}]},
        {**raw, "responses": [{"perf_ns": 1, "text": '{"choices": ['}]},  # a broken body
        {**raw, "error": {"code": "500", "type": "<script>", "message": "secret text"}},
        {"metadata": {**meta, "request_start_ns": -5, "request_end_ns": True}, "metrics": {}},
        {"metadata": {**meta, "request_end_ns": meta["request_start_ns"] - 1}, "metrics": []},
    ]
    path = tmp_path / "profile_export_raw.jsonl"
    path.write_bytes(
        b"\n".join(
            orjson.dumps({**b, "metadata": {**b["metadata"], "x_request_id": str(i)}})
            for i, b in enumerate(bad)
        )
    )
    res = run_cli("audit", str(path), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == len(bad) and out["states"]["unverified"] == len(bad)
    assert out["time"]["span_calls"] == 5  # the two records without a valid interval: none
    assert b"secret text" not in res.stdout and b"<script>" not in res.stdout
    assert "aiperf: the request failed" in {u["reason"] for u in out["unverified"]}


def test_a_prefill_that_took_longer_than_cold_is_said_as_a_loss(tmp_path: Path) -> None:
    def reply(cached: int, prompt_ms: float) -> dict[str, object]:
        usage = {"prompt_tokens": 1000, "completion_tokens": 1}
        timings = {"cache_n": cached, "prompt_n": 1000 - cached, "prompt_ms": prompt_ms}
        return {
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "x"}}],
            "usage": usage | {"prompt_tokens_details": {"cached_tokens": cached}},
            "timings": timings | {"predicted_n": 1, "predicted_ms": 10},
        }

    batch = tmp_path / "calls.jsonl"
    batch.write_bytes(b"\n".join(orjson.dumps(reply(c, ms)) for c, ms in ((0, 1000), (900, 2000))))
    out = audit_json(str(batch))
    assert out["saving"]["seconds"]["saved"] == pytest.approx(-1.0)
    text = run_cli("audit", str(batch)).stdout.decode()
    assert "no prefill time (took 3 s; prefill took 1 s more than cold)" in text
    assert "0 s of prefill" not in text

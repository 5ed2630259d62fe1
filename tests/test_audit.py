"""`prefixreg audit`: totals checked against an independent count, the shared prefix, shares.

The batch is generated here: nested directories, a JSON file with one response and one
with a list, JSON lines with the common wrappers, a malformed file and line, a response
without usage, and a real warm measurement record taken on the simulator. The expected
figures are computed from the same numbers in the test, not by the code under test.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import UsageError
from prefixreg.core.judge import judge, judge_unknown_head
from prefixreg.core.records import CallEvidence, Measurement, ServerBuild
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.audit.read import AuditCall, read_outputs
from prefixreg.verbs.audit.report import DEFAULT_DECODE_TPS, DEFAULT_PREFILL_TPS, PrefixSpan
from prefixreg.verbs.audit.run import audit_calls, match_prefix, run_audit
from prefixreg.verbs.measure.warm import WarmResult
from prefixreg.verbs.measure.warm import warm as warm_head
from tests.conftest import run_cli
from tests.hypothesis_profile import bounded

SYSTEM = "You are a careful coding agent. Follow the repository's conventions.\n" * 60


# --------------------------------------------------------------------------------------
# The batch and its independent arithmetic


@dataclass(frozen=True)
class Row:
    """One call as the test wrote it: the numbers the audit must find."""

    prompt: int | None
    cached: int | None  # None: no cached count reported (the call is unverified)
    completion: int | None
    prompt_ms: float | None = None
    predicted_ms: float | None = None
    wall: float | None = None


def response(row: Row, *, omit_zero_cached: bool = False) -> dict[str, Any]:
    """An OpenAI-style chat response for `row` (Halogen shape: timings beside usage)."""
    out: dict[str, Any] = {
        "id": "chatcmpl-0123456789abcdef01234567",
        "object": "chat.completion",
        "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"content": "ok"}}],
    }
    if row.prompt is not None:
        usage: dict[str, Any] = {
            "prompt_tokens": row.prompt,
            "completion_tokens": row.completion,
            "total_tokens": row.prompt + (row.completion or 0),
        }
        if row.cached is not None and not (omit_zero_cached and row.cached == 0):
            usage["prompt_tokens_details"] = {"cached_tokens": row.cached}
        out["usage"] = usage
    if row.prompt_ms is not None or row.predicted_ms is not None:
        out["timings"] = {
            "prompt_ms": row.prompt_ms,
            "predicted_ms": row.predicted_ms,
            "cache_n": row.cached,
        }
    return out


def expected(rows: list[Row], prefill_tps: float, decode_tps: float) -> dict[str, Any]:
    """The accounting done by hand: the rules of the issue, written out again."""
    verified = [
        r for r in rows if r.prompt is not None and r.cached is not None and r.cached <= r.prompt
    ]
    prompts = [r.prompt for r in rows if r.prompt is not None]
    completions = [r.completion for r in rows if r.completion is not None]
    cached = [r.cached for r in verified if r.cached is not None]
    prefill = decode = wall = model_with_wall = 0.0
    modelled = with_wall = 0
    for r in rows:
        p: float | None = None
        if r.prompt_ms is not None:
            p = r.prompt_ms / 1000
        elif r in verified and r.prompt is not None and r.cached is not None:
            p = (r.prompt - r.cached) / prefill_tps
        d: float | None = None
        if r.predicted_ms is not None:
            d = r.predicted_ms / 1000
        elif r.completion is not None:
            d = r.completion / decode_tps
        if p is None or d is None:
            continue
        modelled += 1
        prefill += p
        decode += d
        if r.wall is not None:
            with_wall += 1
            wall += r.wall
            model_with_wall += p + d
    return {
        "calls": len(rows),
        "reused": sum(1 for r in verified if r.cached),
        "prompt": (sum(prompts), len(prompts)),
        "cached": (sum(cached), len(cached)),
        "completion": (sum(completions), len(completions)),
        "wall": (
            sum(r.wall for r in rows if r.wall is not None),
            sum(r.wall is not None for r in rows),
        ),
        "prefill_s": prefill,
        "decode_s": decode,
        "modelled": modelled,
        "prefill_share": prefill / (prefill + decode),
        "closure": model_with_wall / wall if wall else None,
        "closure_calls": with_wall,
    }


@dataclass
class Batch:
    root: Path
    registry: Path
    warm: WarmResult
    rows: list[Row]
    malformed: set[str]
    unverified: set[str]

    @property
    def span(self) -> int:
        """The head's measured span: what the server counted cached on the warm's check."""
        cached = self.warm.calls[-1].evidence.cached_tokens
        assert cached is not None and self.warm.verdict == "resumed"
        return cached


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batch]:
    base = tmp_path_factory.mktemp("audit")
    reg = Registry(base / "reg")
    reg.add(SYSTEM, name="loop")
    reg.add("An unrelated prefix that was never warmed.\n" * 20, name="other")
    with SimServer(SimConfig(speed=2000)) as sim, Worker(sim.url) as worker:
        warm = warm_head(reg, reg.head("loop"), worker)
    assert warm.verdict == "resumed"
    check = warm.calls[-1].evidence
    assert check.cached_tokens is not None and check.prompt_tokens is not None
    c = check.cached_tokens  # what a fresh tail after this prefix resumes on this build

    root = base / "outputs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "records").mkdir()
    rows: list[Row] = []

    def put(row: Row) -> Row:
        rows.append(row)
        return row

    # A single response (no timings: rates), and a list of two (one with server timings,
    # one cold by its timings.cache_n = 0 with prompt_tokens_details omitted, as Halogen does).
    single = put(Row(c + 40, c - 8, 600))
    (root / "a" / "single.json").write_bytes(orjson.dumps(response(single)))
    timed = put(Row(c + 25, c + 4, 480, prompt_ms=21.5, predicted_ms=7900.0))
    cold = put(Row(c + 30, 0, 300, prompt_ms=2800.0, predicted_ms=5000.0))
    listed = [response(timed), response(cold, omit_zero_cached=True)]
    (root / "a" / "b" / "list.json").write_bytes(orjson.dumps(listed))

    # JSON lines with wrappers and wall times, a blank line, and a line that is not JSON.
    w1 = put(Row(c + 19, c, 720, wall=13.0))
    w2 = put(Row(c + 60, c + 2, 540, wall=9.5))
    w3 = put(Row(c + 22, c - 3, 660, prompt_ms=18.0, predicted_ms=11000.0, wall=11.25))
    lines = [
        orjson.dumps({"response": response(w1), "wall_s": w1.wall}),
        b"",
        orjson.dumps({"body": response(w2), "elapsed_s": w2.wall}),
        b"{this is not json",
        orjson.dumps(  # the OpenAI batch output shape: response.body, one level deeper
            {
                "custom_id": "req-3",
                "error": None,
                "response": {"status_code": 200, "body": response(w3)},
                "latency_s": w3.wall,
            }
        ),
    ]
    (root / "a" / "calls.jsonl").write_bytes(b"\n".join(lines) + b"\n")

    # A response without usage: a call, unverified, adding nothing to any total.
    put(Row(None, None, None))
    (root / "a" / "b" / "nousage.json").write_bytes(orjson.dumps(response(Row(None, None, None))))
    # Not JSON; JSON that is not a call output; a file the walk must skip.
    (root / "broken.json").write_bytes(b'{"choices": [')
    (root / "a" / "notes.json").write_bytes(orjson.dumps({"hello": "world"}))
    (root / "readme.txt").write_text("not a call output, not read")

    # The warm measurement record: each call inside counts, with its recorded wall_s.
    record = Path(warm.record_path)
    shutil.copyfile(record, root / "records" / record.name)
    for call in orjson.loads(record.read_bytes())["body"]["calls"]:
        ev = call["evidence"]
        put(
            Row(
                ev["prompt_tokens"],
                ev["cached_tokens"],
                ev["completion_tokens"],
                ev["prompt_ms"],
                ev["predicted_ms"],
                ev["wall_s"],
            )
        )
    yield Batch(
        root=root,
        registry=reg.root,
        warm=warm,
        rows=rows,
        malformed={
            str(root / "broken.json"),
            str(root / "a" / "calls.jsonl") + ":4",
            str(root / "a" / "notes.json"),
        },
        unverified={str(root / "a" / "b" / "nousage.json")},
    )


# --------------------------------------------------------------------------------------
# The CLI: real processes (`python -m prefixreg audit ...`).


def audit_cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    return run_cli("audit", *args)


def test_json_totals_match_an_independent_count(batch: Batch) -> None:
    res = audit_cli(str(batch.root), "--registry", str(batch.registry), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    exp = expected(batch.rows, DEFAULT_PREFILL_TPS, DEFAULT_DECODE_TPS)

    assert out["calls"] == exp["calls"] == 9
    assert out["calls_with_cached_tokens"] == exp["reused"]
    # The judge's states: every bare response covers the span of the head the batch shares.
    assert out["states"] == {"reused": exp["reused"], "partial": 0, "cold": 2, "unverified": 1}
    for key in ("prompt", "cached", "completion"):
        total, n = exp[key]
        assert (out["tokens"][key]["total"], out["tokens"][key]["calls"]) == (total, n), key
        assert out["tokens"][key]["mean"] == pytest.approx(total / n), key
    t = out["time"]
    assert (t["wall_s"], t["wall_calls"]) == (pytest.approx(exp["wall"][0]), exp["wall"][1])
    assert t["modelled_calls"] == exp["modelled"] == 8
    assert t["prefill_s"] == pytest.approx(exp["prefill_s"])
    assert t["decode_s"] == pytest.approx(exp["decode_s"])
    assert t["prefill_share"] == pytest.approx(exp["prefill_share"])
    assert t["decode_share"] == pytest.approx(1 - exp["prefill_share"])
    assert t["closure"] == pytest.approx(exp["closure"])
    assert t["closure_calls"] == exp["closure_calls"] == 5
    # Server timings on 5 calls (3 responses + the 2 simulator calls), rates on 3.
    assert t["sources"]["prefill"] == {"timings": 5, "rates": 3, "unknown": 1}
    assert t["sources"]["decode"] == {"timings": 5, "rates": 3, "unknown": 1}
    assert t["rates"] == {"prefill_tps": 1180.0, "decode_tps": 60.0, "given": False}

    # Decode dominates, and the report says so in words.
    assert t["dominant"] == "decode"
    pct = round((1 - exp["prefill_share"]) * 100)
    assert out["summary"].startswith(f"decode dominates: {pct}% of modelled time")

    # What caching saved: the uncached tokens split by the head's measured span (every call
    # here is judged against it), the lever decided from that split, not from the time.
    span = batch.span
    counted = [(r.prompt, r.cached) for r in batch.rows if r.prompt is not None]
    miss = sum(max(0, min(span, p) - c) for p, c in counted if c is not None)
    uncached = sum(p - c for p, c in counted if c is not None)
    s = out["saving"]
    assert s["tokens"] == {"cold": exp["prompt"][0], "saved": exp["cached"][0]}
    split = {"new_history": uncached - miss, "session": 0, "drift": 0, "miss": miss, "unknown": 0}
    assert s["uncached"] == split
    assert miss > uncached - miss and s["lever"]["verdict"] == "lever"
    assert out["summary"].endswith("prompt caching is the lever: " + s["lever"]["reason"])

    # The shared prefix: the measured span (on the record's build) that the responses read
    # alone cover, through the judge: 5 of the 6 with counts (the sixth is cold).
    p = out["shared_prefix"]
    assert p["sha256"] == batch.warm.prefix.sha256
    assert p["names"] == ["loop"] and p["registered"] is True
    assert p["method"] == "coverage" and p["build_known"] is True
    assert p["span"]["build_id"] == batch.warm.build.build_id
    assert p["span"]["span_tokens"] == batch.span
    assert (p["support"], p["of"]) == (5, 6)

    assert {m["source"] for m in out["malformed"]} == batch.malformed
    assert {u["source"] for u in out["unverified"]} == batch.unverified
    assert all("readme" not in m["source"] for m in out["malformed"])


def test_text_report_names_the_prefix_and_the_dominant_share(batch: Batch) -> None:
    res = audit_cli(str(batch.root), "--registry", str(batch.registry))
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode()
    exp = expected(batch.rows, DEFAULT_PREFILL_TPS, DEFAULT_DECODE_TPS)
    assert f"calls          {exp['calls']} from 7 files" in text
    assert f"loop ({batch.warm.prefix.sha256[:12]})" in text
    assert "decode dominates:" in text and "prompt caching is the lever:" in text
    assert "malformed (3):" in text and "broken.json: not valid JSON" in text
    assert "usage missing" in text


def test_slow_prefill_rate_makes_prefill_dominate(batch: Batch) -> None:
    res = audit_cli(str(batch.root), "--prefill-tps", "2", "--decode-tps", "500", "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    exp = expected(batch.rows, 2.0, 500.0)
    assert out["time"]["prefill_s"] == pytest.approx(exp["prefill_s"])
    assert out["time"]["decode_s"] == pytest.approx(exp["decode_s"])
    assert out["time"]["dominant"] == "prefill"
    assert out["time"]["rates"]["given"] is True
    pct = round(exp["prefill_share"] * 100)
    assert out["summary"].startswith(f"prefill dominates: {pct}% of modelled time; ")


def test_without_registry_the_record_still_names_the_prefix_by_sha(batch: Batch) -> None:
    res = audit_cli(str(batch.root), "--json")  # the default registry does not exist
    assert res.returncode == 0, res.stderr
    p = orjson.loads(res.stdout)["shared_prefix"]
    assert p["sha256"] == batch.warm.prefix.sha256
    assert p["names"] == [] and p["registered"] is None


def test_records_alone_name_their_prefix_directly(batch: Batch) -> None:
    report = run_audit([batch.root / "records"], registry=Registry(batch.registry))
    assert report.prefix is not None
    assert report.prefix.method == "records"
    assert report.prefix.names == ("loop",)
    assert report.prefix.span is not None
    assert report.prefix.span.span_tokens == batch.span
    assert len(report.calls) == 2


def test_plain_responses_match_across_builds_and_say_the_build_is_unknown(
    batch: Batch,
) -> None:
    report = run_audit([batch.root / "a"], registry=Registry(batch.registry))
    assert report.prefix is not None
    assert report.prefix.sha256 == batch.warm.prefix.sha256
    assert report.prefix.build_known is False
    assert "the batch's build unknown" in report.to_text()


def test_a_count_short_of_every_span_names_nothing_and_is_unverified(
    tmp_path: Path, batch: Batch
) -> None:
    span = batch.span
    short = Row(span * 3, span // 4, 10)  # covers no measured span: no head to compare with
    (tmp_path / "far.json").write_bytes(orjson.dumps(response(short)))
    report = run_audit([tmp_path], registry=Registry(batch.registry))
    assert report.prefix is None
    assert "none named" in report.to_text()
    assert report.states() == {"reused": 0, "partial": 0, "cold": 0, "unverified": 1}
    assert "no head to compare them with" in report.listed("unverified")[0].reason
    # Twice the span covers it: the head is named (a likeness) and the call reused.
    (tmp_path / "far.json").write_bytes(orjson.dumps(response(Row(span * 3, span * 2, 10))))
    report = run_audit([tmp_path], registry=Registry(batch.registry))
    assert report.prefix is not None and report.prefix.method == "coverage"
    assert report.states()["reused"] == 1


def test_nothing_readable_exits_2(tmp_path: Path) -> None:
    res = audit_cli(str(tmp_path / "missing"))
    assert res.returncode == 2
    assert b"no such file or directory" in res.stderr
    assert b"no call outputs or requests read" in res.stderr
    (tmp_path / "bad.json").write_bytes(b"nope")
    assert audit_cli(str(tmp_path / "bad.json")).returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert audit_cli(str(empty)).returncode == 2


def test_missing_path_among_good_ones_is_listed_not_fatal(batch: Batch, tmp_path: Path) -> None:
    res = audit_cli(str(batch.root / "a" / "single.json"), str(tmp_path / "gone"), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["calls"] == 1
    assert out["malformed"] == [
        {"source": str(tmp_path / "gone"), "reason": "no such file or directory"}
    ]


def test_bad_rate_and_bad_registry_are_usage_errors(batch: Batch, tmp_path: Path) -> None:
    assert audit_cli(str(batch.root), "--prefill-tps", "0").returncode == 2
    assert audit_cli(str(batch.root), "--decode-tps", "-5").returncode == 2
    res = audit_cli(str(batch.root), "--registry", str(tmp_path / "nowhere"))
    assert res.returncode == 2 and b"not a registry" in res.stderr


# --------------------------------------------------------------------------------------
# Reading and the rules, in process


def test_counts_that_are_not_strict_integers_are_unverified_not_zero(tmp_path: Path) -> None:
    good = response(Row(1000, 900, 10))
    floaty = response(Row(1000, 900, 10))
    floaty["usage"]["prompt_tokens_details"]["cached_tokens"] = 900.0
    over = response(Row(1000, 1200, 10))  # cached > prompt
    halogen_cold = response(Row(1000, 0, 10), omit_zero_cached=True)  # no count at all
    (tmp_path / "x.json").write_bytes(orjson.dumps([good, floaty, over, halogen_cold]))
    report = audit_calls(read_outputs([tmp_path]))
    states = [c.evidence.cache_state for c in report.calls]
    assert states == ["reused", "unverified", "unverified", "unverified"]
    out: dict[str, Any] = report.to_dict()
    assert (out["tokens"]["cached"]["total"], out["tokens"]["cached"]["calls"]) == (900, 1)
    assert (out["tokens"]["prompt"]["total"], out["tokens"]["prompt"]["calls"]) == (4000, 4)
    # Prefill by rate needs a verified cached count: only the good call is fully modelled
    # (the others still decode by rate, but are not counted in the shares).
    times = out["time"]
    assert times["modelled_calls"] == 1
    assert times["prefill_s"] == pytest.approx(100 / DEFAULT_PREFILL_TPS)
    assert times["sources"]["prefill"] == {"timings": 0, "rates": 1, "unknown": 3}


def test_wall_keys_and_wrappers(tmp_path: Path) -> None:
    r = response(Row(100, 0, 6))
    docs = [
        {"response": r, "duration_s": 2},
        {"body": {"response": r}, "latency_s": 1.5},
        {"response": r, "wall_s": True},  # a boolean is not a duration
        {"response": r, "wall_s": -1.0},
        {**r, "elapsed_s": 0.5},
    ]
    path = tmp_path / "w.ndjson"
    path.write_bytes(b"\n".join(orjson.dumps(d) for d in docs))
    data = read_outputs([path])
    assert [c.evidence.wall_s for c in data.calls] == [2.0, 1.5, None, None, 0.5]
    assert data.malformed == []


def test_a_json_file_holding_json_lines_is_read_as_lines(tmp_path: Path) -> None:
    r = orjson.dumps(response(Row(100, 0, 6)))
    (tmp_path / "lines.json").write_bytes(r + b"\n" + r + b"\n")
    assert len(read_outputs([tmp_path]).calls) == 2


def test_corrupt_measurement_record_is_listed(tmp_path: Path, batch: Batch) -> None:
    record = orjson.loads(Path(batch.warm.record_path).read_bytes())
    record["build"]["build_id"] = "0" * 16  # no longer matches its identity
    (tmp_path / "m.json").write_bytes(orjson.dumps(record))
    data = read_outputs([tmp_path])
    assert data.calls == []
    assert len(data.malformed) == 1
    assert data.malformed[0].reason.startswith("corrupt measurement record")


def test_symlinked_directory_loop_terminates(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "r.json").write_bytes(orjson.dumps(response(Row(10, 0, 1))))
    (tmp_path / "d" / "loop").symlink_to(tmp_path / "d")
    assert len(read_outputs([tmp_path]).calls) == 1


def _call(
    cached: int, *, sha: str | None = None, build: str | None = None, prompt: int | None = None
) -> AuditCall:
    ev = CallEvidence(
        prompt_tokens=cached + 20 if prompt is None else prompt,
        cached_tokens=cached,
        completion_tokens=5,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state="reused" if cached else "cold",
        complete=True,
    )
    return AuditCall("t", ev, sha, build)


def test_match_stays_on_the_batch_build_and_prefers_the_closest() -> None:
    a, b = "a" * 64, "b" * 64
    spans = [
        PrefixSpan(a, "build-1", 10_000, 0, "2025-01-01T00:00:00Z", "warm"),
        PrefixSpan(b, "build-2", 10_010, 0, "2025-01-02T00:00:00Z", "warm"),
        PrefixSpan(b, "build-1", 10_150, 0, "2025-01-02T00:00:00Z", "warm"),
    ]
    calls = [_call(10_012), _call(0, sha="c" * 64, build="build-1")]
    m = match_prefix(calls, spans)
    # build-2's span is closest, but the batch ran on build-1 (its record says so).
    assert m is not None and m.span is not None and m.build_known
    assert (m.sha256, m.span.build_id) == (a, "build-1")
    m = match_prefix([_call(10_012)], spans)  # no build known: every build is searched
    assert m is not None and m.span is not None and not m.build_known
    assert (m.sha256, m.span.build_id) == (b, "build-2")
    # 20,000 cached covers every span: the longest it covers names the head.
    m = match_prefix([_call(20_000)], spans)
    assert m is not None and m.span == spans[2]
    assert match_prefix([_call(5_000)], spans) is None  # short of every span: partial
    assert match_prefix([_call(0)], spans) is None  # nothing cached: covers nothing


def test_alignment_widens_the_allowance() -> None:
    a = "a" * 64
    # Halogen dense rounds cached counts down to multiples of 2048: a 45,000-token span
    # resumes 43,008 (21 x 2048), 1,992 short: more than the judge's 32 template tokens,
    # within the alignment (the judge's allowance is alignment + 32).
    aligned = [PrefixSpan(a, "d", 45_000, 2048, "2025-01-01T00:00:00Z", "warm")]
    m = match_prefix([_call(43_008, prompt=46_000)], aligned)
    assert m is not None and m.span == aligned[0] and m.support == 1
    unaligned = [PrefixSpan(a, "d", 45_000, 0, "2025-01-01T00:00:00Z", "warm")]
    assert match_prefix([_call(43_008, prompt=46_000)], unaligned) is None
    # A prompt shorter than the span cannot hold the head: no head, not a likeness.
    assert match_prefix([_call(43_008)], aligned) is None


# --------------------------------------------------------------------------------------
# Issue 20: every state is the judge's, and the shared head is named by bytes or coverage


def measured(reg: Registry, sha: str, span: int) -> str:
    """A resumed warm measurement of `sha` whose check counted `span` cached tokens, on a
    build of its own (a real record, written through the registry)."""
    build = ServerBuild(profile="llama.cpp", identity={"model": "gemma-3-270m"})
    body: dict[str, Any] = {"verdict": "resumed", "span_tokens": span, "alignment": 0}
    body |= {"cached_tokens": span, "prompt_tokens": span + 12}
    reg.write_measurement(
        Measurement(
            sha256=sha,
            at="2026-01-01T00:00:00.000000Z",
            kind="warm",
            build=build,
            body=body | {"calls": [{"phase": "warm"}, {"phase": "check"}]},
        )
    )
    return build.build_id


def pair(system: str, tail: str, row: Row) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": tail}]
    return orjson.dumps({"request": {"messages": messages}, "response": response(row)})


def test_case5_nine_cached_tokens_of_a_1370_token_head_are_partial(tmp_path: Path) -> None:
    """Issue 20, case 5: batch 9 / 1,370 / 0 / 1,370 cached of 1,382 prompt tokens."""
    reg = Registry(tmp_path / "reg")
    sha = reg.add("You are the agent. Follow the plan step by step.\n" * 100, name="agent")
    measured(reg, sha, 1370)
    rows = [Row(1382, 9, 10), Row(1382, 1370, 10), Row(1382, 0, 10), Row(1382, 1370, 10)]
    bare = tmp_path / "bare.jsonl"
    bare.write_bytes(b"".join(orjson.dumps(response(r)) + b"\n" for r in rows))
    res = audit_cli(str(bare), "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["states"] == {"reused": 2, "partial": 1, "cold": 1, "unverified": 0}
    assert out["partial"] == [
        {
            "source": f"{bare}:1",
            "reason": "9 cached tokens, short of the head's measured span of 1,370",
        }
    ]
    # Totals are the server's numbers, whatever the labels: every verified count counts.
    assert (out["tokens"]["cached"]["total"], out["tokens"]["cached"]["calls"]) == (2749, 4)
    assert out["calls_with_cached_tokens"] == 3
    p = out["shared_prefix"]
    assert (p["sha256"], p["method"], p["support"], p["of"]) == (sha, "coverage", 2, 4)
    text = audit_cli(str(bare), "--registry", str(reg.root)).stdout.decode()
    assert "(reused 2, partial 1, cold 1, unverified 0)" in text
    assert "2 of 4 calls read alone cover its measured span of 1,370 tokens" in text

    # The same batch with its requests: each call is judged against the bytes it sent
    # (the judge's byte estimate: the request carries no build to look a span up on).
    system = "x" * 5000
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_bytes(
        b"".join(pair(system, f"question {i:>12}", r) + b"\n" for i, r in enumerate(rows))
    )
    report = run_audit([pairs])
    assert report.states() == {"reused": 2, "partial": 1, "cold": 1, "unverified": 0}
    assert [v.span_source for v in report.verdicts] == ["estimated"] * 4


AIPERF_SYS = "You are aiperf's synthetic system prompt, seventeen of them.\n" * 100


def aiperf_batch(path: Path, cached: list[int]) -> None:
    """Pairs as a benchmark logs them: one registered system prompt, 1,587 prompt tokens."""
    tail = "Summarise the following passage in one sentence. " * 6
    rows = [Row(1587, c, 64, wall=0.8) for c in cached]
    path.write_bytes(b"".join(pair(AIPERF_SYS, tail, r) + b"\n" for r in rows))


def test_case9_seven_cached_tokens_are_not_reused_and_one_cold_call_keeps_the_name(
    tmp_path: Path,
) -> None:
    """Issue 20, case 9 (NVIDIA aiperf against llama-server): two calls with 7 of 1,587
    tokens cached, and a cold one, among 16 requests byte-identical to a registered head
    that was measured elsewhere (the old mean of cached counts left its window)."""
    reg = Registry(tmp_path / "reg")
    sha = reg.add(AIPERF_SYS, name="aiperf-sys17")
    measured(reg, sha, 1552)
    batch = tmp_path / "profile_export.jsonl"
    cached = [1552] * 13 + [7, 7, 0]
    aiperf_batch(batch, cached)
    res = audit_cli(str(batch), "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["states"] == {"reused": 13, "partial": 2, "cold": 1, "unverified": 0}
    assert [p["source"] for p in out["partial"]] == [f"{batch}:14", f"{batch}:15"]
    assert out["system_prefix"]["identical"] == 16
    p = out["shared_prefix"]
    assert (p["sha256"], p["names"], p["method"]) == (sha, ["aiperf-sys17"], "identity")
    assert (p["support"], p["of"], p["registered"]) == (16, 16, True)
    text = audit_cli(str(batch), "--registry", str(reg.root)).stdout.decode()
    assert "16 of 16 requests byte-identical to aiperf-sys17" in text
    assert f"shared prefix  aiperf-sys17 ({sha[:12]}) (byte identity: 16 of 16" in text
    assert "none named" not in text and "reused 15" not in text
    # All cold: still the same head, named by its bytes.
    aiperf_batch(batch, [0] * 16)
    report = run_audit([batch], registry=reg)
    assert report.prefix is not None and report.prefix.sha256 == sha
    assert report.states()["cold"] == 16


def test_labels_equal_the_judge_on_every_call(tmp_path: Path) -> None:
    """No label of the audit says more than the judge on the same numbers."""
    batch = tmp_path / "b.jsonl"
    cached = [0, 7, 700, 1400, 1500, 1552, 1587, 1600]
    aiperf_batch(batch, cached)
    report = run_audit([batch])
    size = len(AIPERF_SYS.encode())
    for call, verdict in zip(report.calls, report.verdicts, strict=True):
        assert call.head_bytes == size and call.rest_bytes is not None
        assert verdict == judge(call.evidence, head_bytes=size, rest_bytes=call.rest_bytes)
    assert [v.verdict for v in report.verdicts] == [
        "cold", "partial", "partial", "partial", "resumed", "resumed", "resumed", "unverified"
    ]  # fmt: skip


@bounded(200)
@given(
    prompt=st.none() | st.integers(0, 10**6),
    cached=st.none() | st.integers(0, 10**6),
    state=st.sampled_from(["cold", "reused", "unverified"]),
    complete=st.booleans(),
)
def test_judge_unknown_head_never_says_more_than_cold(
    prompt: int | None, cached: int | None, state: Any, complete: bool
) -> None:
    ev = CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state=state,
        complete=complete,
    )
    j = judge_unknown_head(ev, "no head")
    assert j.verdict in ("cold", "unverified")
    counted = state != "unverified" and prompt is not None and cached is not None
    assert (j.verdict == "cold") == (counted and cached == 0)
    if counted and cached and prompt is not None and cached <= prompt:
        assert j.reason == "no head"


# --------------------------------------------------------------------------------------
# Issue 21 and 22: the library takes checked objects; hostile inputs are listed, not fatal


def test_run_audit_refuses_wrong_types(tmp_path: Path) -> None:
    good = tmp_path / "r.json"
    good.write_bytes(orjson.dumps(response(Row(100, 0, 5))))
    wrong: list[tuple[Any, dict[str, Any]]] = [
        (str(good), {}),  # a string is not a list of paths
        ([good], {"frame": "loop"}),  # a reference, not a verified Frame
        ([good], {"registry": str(tmp_path)}),
        ([good], {"prefill_tps": "fast"}),
        ([good], {"decode_tps": math.inf}),
    ]
    for paths, kwargs in wrong:
        with pytest.raises(UsageError):
            run_audit(paths, **kwargs)


def test_on_an_aligned_engine_responses_read_alone_match_the_span_a_warm_confirmed(
    tmp_path: Path,
) -> None:
    # Halogen dense counts cached tokens in 2,048-token units: no span is measured there,
    # but the estimate a resumed warm covered still names the batch's head, as an estimate.
    reg = Registry(tmp_path / "reg")
    text = "".join(f"Rule {i}: keep functions short and names plain.\n" for i in range(400))
    reg.add(text, name="p")
    head = reg.get("p")
    body = head.body([{"role": "user", "content": "a question of the loop"}], max_tokens=4)
    with SimServer(SimConfig.for_profile("dense", speed=500)) as sim, Worker(sim.url) as w:
        result = warm_head(reg, reg.head("p"), w)
        reply = httpx.post(f"{sim.url}/v1/chat/completions", json=body, timeout=60).json()
    assert result.verdict == "resumed" and result.judgement is not None
    assert result.judgement.span_source == "estimated"
    out = tmp_path / "reply.json"
    out.write_bytes(orjson.dumps(reply))
    report = run_audit([out], registry=reg)
    assert report.prefix is not None and report.prefix.sha256 == head.sha256
    assert report.prefix.span is not None and report.prefix.span.source == "estimated"
    (verdict,) = report.verdicts
    assert verdict.verdict == "resumed" and verdict.span_source == "estimated", verdict
    assert "estimated span" in report.to_text()

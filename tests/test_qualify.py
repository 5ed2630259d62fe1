"""`prefixreg qualify` against the simulator: every profile, the acceptance runs, the CLI's exit
codes and the receipt's allowlist. Token counts are read from the server's replies, never
assumed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

import prefixreg
from prefixreg.core.errors import UsageError
from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.qualify.prompts import FIXTURE
from prefixreg.verbs.qualify.run import QualifyResult, qualify
from tests.conftest import run_cli

COMPLETIONS = ("POST", "/v1/completions")


def sim(**knobs: Any) -> SimServer:
    return SimServer(SimConfig(speed=2000, **knobs)).start()


@pytest.fixture
def halogen() -> Iterator[SimServer]:
    with sim() as server:
        yield server


def run(server: SimServer, **kwargs: Any) -> QualifyResult:
    with Worker(server.url) as w:
        return qualify(w, **kwargs)


def sent(server: SimServer) -> int:
    return sum(1 for r in server.requests() if (r.method, r.path) == COMPLETIONS)


def test_first_cold_repeats_reused_concurrent_judged_per_request(halogen: SimServer) -> None:
    result = run(halogen, repeats=2, streams=3, require_cold=True, require_reuse=True)
    assert result.qualified, result.failures
    phases = [r.phase for r in result.rows]
    assert phases == ["first", "repeated", "repeated", "concurrent", "concurrent", "concurrent"]
    assert sent(halogen) == 6  # no warm-up, no extra call
    reads = {(r.method, r.path) for r in halogen.requests()} - {COMPLETIONS}
    assert reads <= {("GET", "/health"), ("GET", "/cache"), ("GET", "/v1/models")}  # no reset
    first, *later = result.rows
    assert first.evidence.cache_state == "cold" and first.evidence.cached_tokens == 0
    prompt = first.evidence.prompt_tokens
    assert prompt and all(r.evidence.prompt_tokens == prompt for r in later)
    for row in later:
        assert row.evidence.cache_state == "reused", row
        assert 0 < (row.evidence.cached_tokens or 0) <= prompt
        assert row.output_vs_first == "pass"
        assert row.tokens_vs_first == "unverified"  # the sim sends no token hash: never a pass
    assert result.receipt["counts"]["tokens_pass"] == 0
    assert result.receipt["counts"]["tokens_unverified"] == 5
    assert all(r["cache_deltas"] is not None for r in result.receipt["rows"][:3])


def test_expected_prompt_tokens_exact_passes_and_wrong_fails_naming_the_reported(
    halogen: SimServer,
) -> None:
    n = run(halogen, repeats=1, streams=1).rows[0].evidence.prompt_tokens
    assert n is not None
    assert run(halogen, repeats=1, streams=1, expected_prompt_tokens=n).qualified
    wrong = run(halogen, repeats=1, streams=1, expected_prompt_tokens=n + 1)
    assert not wrong.qualified
    assert f"reported {n:,} prompt tokens, expected {n + 1:,}" in wrong.failures[0]


@pytest.mark.parametrize(
    "knobs",
    [
        {"max_entries": 0},  # a Halogen sim whose cache is off
        {"engine": "vllm", "cache_report": False},
        {"engine": "sglang", "cache_report": False},
        {"engine": "ollama", "cache_report": False},
    ],
    ids=["halogen-cache-off", "vllm", "sglang", "ollama"],
)
def test_require_reuse_fails_exit_1_with_receipt_where_reuse_is_not_reported(
    tmp_path: Path, knobs: dict[str, Any]
) -> None:
    out = tmp_path / "receipt.json"
    with sim(**knobs) as server:
        res = run_cli("qualify", "--worker", server.url, "--output", str(out), "--require-reuse")
    assert res.returncode == 1, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["qualified"] is False
    repeated = [r for r in receipt["rows"] if r["phase"] == "repeated"]
    assert repeated and all(r["cache_state"] != "reused" for r in repeated)
    assert any("--require-reuse" in why for why in receipt["failures"])
    assert all(r["complete"] for r in receipt["rows"])  # the evidence is all there


@pytest.mark.parametrize("engine", [None, "vllm", "sglang", "trtllm", "ollama"])
def test_every_engine_profile_qualifies_with_its_own_zero_rules(engine: str | None) -> None:
    with sim(engine=engine) as server:
        result = run(server, repeats=1, streams=2, require_reuse=True)
    assert result.build is not None
    assert result.build.profile == (engine or "halogen")
    assert result.qualified, result.failures
    first = result.rows[0].evidence
    # vLLM, TensorRT-LLM, Ollama and the Halogen sim send an explicit count; SGLang's null
    # is a zero only by its rule with the cache report known on.
    assert first.cache_state == "cold", first
    if engine == "sglang":
        assert first.cached_source is not None and first.cached_source.startswith("sglang:")


def test_a_cached_reply_with_other_bytes_differs_and_is_not_qualified(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with sim(cached_differs=True) as server:
        res = run_cli("qualify", "--worker", server.url, "--output", str(out), "--json")
    assert res.returncode == 1, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert orjson.loads(res.stdout) == receipt
    assert receipt["qualified"] is False
    later = receipt["rows"][1:]
    assert later and all(r["output_vs_first"] == "differ" for r in later)
    assert all(r["cache_state"] == "reused" for r in later)
    assert receipt["counts"]["output_differ"] == len(later)


def test_receipt_holds_no_url_model_prompt_or_path(tmp_path: Path) -> None:
    prompt_text = "A private prompt about project nightjar-7731, never to be published.\n" * 20
    prompt_file = tmp_path / "secret-prompt-dir" / "prompt.txt"
    prompt_file.parent.mkdir()
    prompt_file.write_text(prompt_text)
    out = tmp_path / "receipt-out.json"
    model = "private-alias-quokka"
    with sim(model=model) as server:
        args = ["--worker", server.url, "--model", model, "--prompt-file", str(prompt_file)]
        res = run_cli("qualify", *args, "--output", str(out))
        url, port = server.url, str(server.port)
    assert res.returncode == 0, res.stderr
    text = out.read_text()
    for private in (url, f"127.0.0.1:{port}", model, prompt_file.name, str(prompt_file.parent)):
        assert private not in text, private
    assert "nightjar" not in text and prompt_text[:40] not in text
    assert str(tmp_path) not in text and "secret-prompt-dir" not in text
    for private in (url, model, "nightjar", str(tmp_path)):
        assert private not in res.stdout.decode(), private  # the summary is as shareable
    receipt = json.loads(text)
    assert receipt["prompt"] == {"kind": "text", "source": "file"}
    assert "not a model certification" in " ".join(receipt["not"])
    assert "not a RAM sizing" in " ".join(receipt["not"])
    import hashlib

    assert receipt["fixture_sha256"] == hashlib.sha256(json.dumps(prompt_text).encode()).hexdigest()


def test_builtin_fixture_hash_follows_the_benchmark_rule(halogen: SimServer) -> None:
    import hashlib

    result = run(halogen, repeats=1, streams=1)
    assert (
        result.receipt["fixture_sha256"] == hashlib.sha256(json.dumps(FIXTURE).encode()).hexdigest()
    )
    assert result.receipt["prompt"] == {"kind": "text", "source": "builtin"}


def test_token_prompt_on_an_engine_that_takes_one(tmp_path: Path) -> None:
    ids = list(range(1000, 1300))
    path = tmp_path / "ids.json"
    path.write_text(json.dumps(ids))
    with sim(engine="vllm") as server:
        result = run(server, prompt_file=path, repeats=1, streams=1, require_reuse=True)
        n = result.rows[0].evidence.prompt_tokens
        assert n is not None
        exact = run(server, prompt_file=path, repeats=1, streams=1, expected_prompt_tokens=n)
    assert result.qualified, result.failures
    assert exact.qualified, exact.failures
    assert result.receipt["prompt"] == {"kind": "tokens", "source": "file"}
    shared = json.dumps(result.receipt)
    assert "1000, 1001" not in shared and "1000,1001" not in shared  # the prompt's IDs stay home
    assert "decode_tps" in result.receipt["figures"]


@pytest.mark.parametrize("knobs", [{"profile": "dense"}, {"engine": "ollama"}])
def test_token_prompt_refused_before_any_request_where_known_text_only(
    tmp_path: Path, knobs: dict[str, Any]
) -> None:
    path = tmp_path / "ids.json"
    path.write_text("[1, 2, 3]")
    out = tmp_path / "r.json"
    profile = knobs.pop("profile", "flash")
    with SimServer(SimConfig.for_profile(profile, speed=2000, **knobs)).start() as server:
        args = ["--worker", server.url, "--prompt-file", str(path), "--output", str(out)]
        res = run_cli("qualify", *args)
        assert sent(server) == 0
    assert res.returncode == 2, res.stderr
    assert b"takes a string prompt" in res.stderr and b"Traceback" not in res.stderr
    assert not out.exists()


def test_token_prompt_an_engine_refuses_is_exit_5_naming_it(tmp_path: Path) -> None:
    """Halogen Flash's token prompts are unverified: tried once; the sim refuses them."""
    path = tmp_path / "ids.json"
    path.write_text("[1, 2, 3]")
    out = tmp_path / "r.json"
    with sim() as server:
        res = run_cli(
            "qualify", "--worker", server.url, "--prompt-file", str(path), "--output", str(out)
        )
        assert sent(server) == 1
    assert res.returncode == 5, res.stderr
    assert b"must be a string" in res.stderr and b"token-ID prompt" in res.stderr
    assert orjson.loads(out.read_bytes())["error"] == "WorkerHTTPError"


@pytest.mark.parametrize(
    "content",
    ["[]", "[1, true]", "[1, 2.0]", '[1, "2"]', "[-1]", f"[{1 << 32}]", "[1, 2", '{"a": 1}x'],
)
def test_bad_token_files_are_usage_errors_nothing_sent(
    halogen: SimServer, tmp_path: Path, content: str
) -> None:
    path = tmp_path / "ids.json"
    path.write_text(content)
    res = run_cli(
        "qualify",
        "--worker",
        halogen.url,
        "--prompt-file",
        str(path),
        "--output",
        str(tmp_path / "r"),
    )
    if content.startswith("{"):  # not an array: read as text, a valid prompt
        assert res.returncode == 0, res.stderr
        return
    assert res.returncode == 2, res.stderr
    assert res.stderr.count(b"\n") <= 2 and b"--prompt-file" in res.stderr
    assert sent(halogen) == 0


def test_output_refused_before_any_request(halogen: SimServer, tmp_path: Path) -> None:
    res = run_cli("qualify", "--worker", halogen.url, "--output", str(tmp_path))
    assert res.returncode == 2 and b"--output" in res.stderr
    res = run_cli("qualify", "--worker", halogen.url, "--output", str(tmp_path / "no" / "x"))
    assert res.returncode == 2
    assert halogen.requests() == []


def test_output_inside_a_registry_refused_before_any_request(
    halogen: SimServer, tmp_path: Path
) -> None:
    reg = tmp_path / "reg"
    env = {"PREFIXREG_HOME": str(reg)}
    assert run_cli("add", "-", "--name", "loop", input_bytes=b"head", env=env).returncode == 0
    marker = (reg / "REGISTRY.json").read_bytes()
    for inside in (reg / "REGISTRY.json", reg / "names" / "loop", reg / "receipt.json"):
        res = run_cli("qualify", "--worker", halogen.url, "--output", str(inside), env=env)
        assert res.returncode == 2, res.stderr
        assert b"inside the registry" in res.stderr
    # Named through a symlink outside, and for a registry not in use: refused the same.
    (tmp_path / "link").symlink_to(reg)
    res = run_cli("qualify", "--worker", halogen.url, "--output", str(tmp_path / "link" / "r"))
    assert res.returncode == 2 and b"inside the registry" in res.stderr
    assert halogen.requests() == []
    assert (reg / "REGISTRY.json").read_bytes() == marker
    assert run_cli("verify", env=env).returncode == 0


def test_unreachable_worker_exits_5_and_still_writes_the_receipt(tmp_path: Path) -> None:
    server = sim()
    url = server.url
    server.stop()
    out = tmp_path / "r.json"
    res = run_cli("qualify", "--worker", url, "--output", str(out))
    assert res.returncode == 5, res.stderr
    receipt = orjson.loads(out.read_bytes())
    assert receipt["qualified"] is False and receipt["error"] == "WorkerUnreachableError"
    assert url not in out.read_text() and "127.0.0.1" not in out.read_text()


def test_registry_records_one_measurement_per_phase_bound_to_the_build(
    halogen: SimServer, tmp_path: Path
) -> None:
    reg = Registry(tmp_path / "reg")
    result = run(halogen, repeats=2, streams=2, registry=reg)
    assert len(result.measurements) == 3
    found = [m for m in reg.measurements() if m.kind == "qualify"]
    assert sorted(str(m.body["phase"]) for m in found) == ["concurrent", "first", "repeated"]
    assert result.build is not None
    assert {m.build.build_id for m in found} == {result.build.build_id}
    by_phase = {m.body["phase"]: m.body["calls"] for m in found}
    assert [len(list(by_phase[p] or [])) for p in ("first", "repeated", "concurrent")] == [1, 2, 2]  # type: ignore[arg-type]


def test_front_door_and_argument_checks(halogen: SimServer) -> None:
    assert prefixreg.qualify is qualify
    with Worker(halogen.url) as w:
        with pytest.raises(TypeError) as err:
            qualify(w, repeats="2")  # type: ignore[arg-type]
        assert isinstance(err.value, UsageError) and "repeats" in str(err.value)
        with pytest.raises(ValueError) as verr:
            qualify(w, streams=0)
        assert isinstance(verr.value, UsageError) and "streams" in str(verr.value)
        with pytest.raises(TypeError):
            qualify(halogen.url)  # type: ignore[arg-type]
    assert halogen.requests() == []


def test_help_explains(halogen: SimServer) -> None:
    res = run_cli("qualify", "--help")
    assert res.returncode == 0
    text = res.stdout.decode()
    for words in ("--require-cold", "--require-reuse", "not a model", "unverified", "--output"):
        assert words in " ".join(text.split()), words


def test_doctor_cites_the_latest_qualify_run_of_this_build(tmp_path: Path) -> None:
    from prefixreg.verbs.doctor.run import doctor

    reg = Registry(tmp_path / "reg")
    with sim(cached_differs=True) as server, Worker(server.url) as w:
        assert not [f for f in doctor(w, reg).findings if f.topic == "qualify"]
        qualify(w, repeats=1, streams=1, registry=reg)
        cited = [f for f in doctor(w, reg).findings if f.topic == "qualify"]
    assert len(cited) == 1 and cited[0].level == "info"
    assert "not qualified" in cited[0].text and "output fingerprint differs" in cited[0].text
    with sim() as other, Worker(other.url) as w:  # the same build: the later run is cited
        qualify(w, repeats=1, streams=1, registry=reg)
        cited = [f for f in doctor(w, reg).findings if f.topic == "qualify"]
    assert len(cited) == 1 and ": qualified" in cited[0].text


def test_halogen_dense_first_is_unverified_not_cold_repeats_reused() -> None:
    """Dense sends no `timings` and omits a zero count: a cold first call cannot be proven."""
    with SimServer(SimConfig.for_profile("dense", speed=2000)).start() as server:
        result = run(server, repeats=1, streams=2, require_cold=True, require_reuse=True)
    assert result.build is not None and result.build.profile == "halogen"
    first, repeated = result.rows[0].evidence, result.rows[1].evidence
    assert first.cache_state == "unverified" and first.cached_tokens is None
    assert repeated.cache_state == "reused"
    assert not result.qualified and "--require-cold" in result.failures[0]
    assert not any("--require-reuse" in why for why in result.failures)


def test_probe_cites_the_latest_qualify_run_of_this_build(tmp_path: Path) -> None:
    from prefixreg.verbs.probe.options import ProbeOptions
    from prefixreg.verbs.probe.run import run_probe as probe

    reg = Registry(tmp_path / "reg")
    with sim() as server, Worker(server.url) as w:
        before = probe(reg, w, ProbeOptions(sizes=(4000,), foreign=1))
        qualify(w, repeats=1, streams=1, registry=reg)
        after = probe(reg, w, ProbeOptions(sizes=(4000,), foreign=1))
    assert before.qualify is None and before.to_dict()["qualify"] is None
    assert after.qualify is not None and ": qualified" in after.qualify
    assert after.to_dict()["qualify"] == after.qualify
    assert f"- qualify: {after.qualify}" in after.to_markdown()

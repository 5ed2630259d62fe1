"""The one judge (`prefixreg.core.judge`): properties over any counts, and issue 20's cases
that belong to warm (implausible counts, per-call labels, the alignment named).

Real loopback servers only: the simulator and `tests/fakeserver.py`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.errors import UsageError
from prefixreg.core.judge import (
    MAX_BYTES_PER_TOKEN,
    Judgement,
    allowance,
    judge,
    judge_copy,
    judge_resident,
    judge_restore,
    judge_same_build,
    judge_survival,
    judge_unknown_head,
    judge_unproven,
    judge_warm_only,
    min_tokens,
)
from prefixreg.core.records import CallEvidence
from prefixreg.registry.store import Registry
from prefixreg.sim import SimConfig, SimServer
from tests.conftest import run_cli
from tests.fakeserver import FakeServer, Reply, sse_frames
from tests.test_worker import HALOGEN_CACHE, HALOGEN_HEALTH

CHAT = "/v1/chat/completions"
counts = st.one_of(st.none(), st.integers(min_value=0, max_value=200_000))


def evidence(prompt: int | None, cached: int | None, *, complete: bool = True) -> CallEvidence:
    valid = complete and prompt is not None and cached is not None and cached <= prompt
    state = ("cold" if cached == 0 else "reused") if valid else "unverified"
    return CallEvidence(
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=1,
        cached_source="usage.prompt_tokens_details.cached_tokens",
        cache_state=state,  # type: ignore[arg-type]
        complete=complete,
        reason=None if valid else "as the server sent it",
    )


@given(
    prompt=counts,
    cached=counts,
    complete=st.booleans(),
    head_bytes=st.integers(min_value=0, max_value=400_000),
    rest_bytes=st.integers(min_value=0, max_value=100_000),
    alignment=st.sampled_from([0, 1, 64, 256, 2048]),
    measured=st.one_of(st.none(), st.integers(min_value=-5, max_value=200_000)),
    tools=st.one_of(st.none(), st.integers(min_value=0, max_value=500)),
)
def test_resumed_only_on_plausible_counts_that_cover_the_span(
    prompt: int | None,
    cached: int | None,
    complete: bool,
    head_bytes: int,
    rest_bytes: int,
    alignment: int,
    measured: int | None,
    tools: int | None,
) -> None:
    ev = evidence(prompt, cached, complete=complete)
    j = judge(
        ev,
        head_bytes=head_bytes,
        rest_bytes=rest_bytes,
        alignment=alignment,
        measured_span=measured,
        tools_tokens=tools,
    )
    assert j.verdict in ("resumed", "partial", "cold", "unverified") and j.reason
    if j.verdict != "resumed":
        return
    assert complete and prompt is not None and cached is not None
    assert 0 < cached <= prompt
    assert prompt >= math.ceil(head_bytes / MAX_BYTES_PER_TOKEN)  # plausible for the bytes
    assert j.span is not None and j.span >= 1
    assert j.span <= prompt and (j.span_source == "measured" or j.span <= max(head_bytes, 1))
    assert cached >= j.span - allowance(j.span, alignment)  # covers the span less allowance
    assert allowance(j.span, alignment) <= j.span // 2
    assert tools != 0  # tools the template drops are never "resumed"


@given(prompt=st.integers(min_value=0, max_value=10_000), head=st.integers(1, 2_000_000))
def test_fewer_prompt_tokens_than_the_bytes_allow_is_unverified(prompt: int, head: int) -> None:
    j = judge(evidence(prompt, prompt), head_bytes=head, rest_bytes=0)
    if prompt < min_tokens(head):
        assert j.verdict == "unverified" and "cannot hold" in j.reason
    else:
        assert j.verdict != "unverified"


def test_restore_resident_and_copy_verdicts() -> None:
    resumed = Judgement("resumed", "covered", span=100, coverage=1.0)
    cold = Judgement("cold", "0 cached", span=100, coverage=0.0)
    unknown = Judgement("unverified", "no counts")
    assert judge_restore(cold, 500, resumed)[0] == "restored"
    assert judge_restore(None, 500, resumed)[0] == "restored"  # an erased slot is a baseline
    assert judge_restore(resumed, 500, resumed)[0] == "resident"  # held it before: no proof
    assert judge_restore(cold, 0, resumed)[0] == "not_restored"  # loaded nothing
    assert judge_restore(cold, None, resumed)[0] == "not_restored"
    assert judge_restore(cold, 500, cold)[0] == "not_restored"
    assert judge_restore(unknown, 500, resumed)[0] == "unverified"
    assert judge_resident(resumed, 0)[0] is True
    assert judge_resident(resumed, 1)[0] is False  # a later prefill makes the proof stale
    assert judge_resident(cold, 0)[0] is False
    assert judge_copy(True, True) == "verified"
    assert judge_copy(False, True) == "unchecked"  # never "verified" for bytes not hashed
    assert judge_copy(True, False) == "mismatch"
    assert judge_copy(True, None) == "unchecked"


# -- issue 20, case 4: counts impossible for the bytes are unverified, end to end ---------------


def _reply(prompt: int, cached: int) -> Reply:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    frames: list[Any] = [
        {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": usage},
    ]
    return Reply(sse=sse_frames(frames))


def test_two_tokens_for_a_7200_byte_prefix_is_not_resumed(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(("Careful coding agent; keep to the house style. " * 160)[:7199] + "\n", name="big")
    assert reg.meta(reg.resolve("big")).bytes == 7200
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, _reply(2, 2))
        res = run_cli("warm", "big", "--worker", srv.url, "--registry", str(reg.root), "--json")
    assert res.returncode == 4, (res.stdout, res.stderr)
    body = orjson.loads(res.stdout)["body"]
    assert body["verdict"] == "unverified" and "cannot hold" in body["reason"], body


# -- issue 20, case 9 (warm's part): each call's label is the judge's, not "reused" ------------


def test_a_warm_call_with_seven_cached_tokens_is_labelled_partial(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add("You are a careful coding agent. Keep the repository's conventions.\n" * 90, name="p")
    with FakeServer() as srv:
        srv.route("GET", "/health", Reply(json=HALOGEN_HEALTH))
        srv.route("GET", "/cache", Reply(json=HALOGEN_CACHE))
        srv.route("POST", CHAT, _reply(1587, 7))
        res = run_cli("warm", "p", "--worker", srv.url, "--registry", str(reg.root))
    assert res.returncode == 1, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.decode().splitlines()}
    assert "cached 7" in lines["warm"] and "(partial)" in lines["warm"], lines["warm"]
    assert "(reused)" not in res.stdout.decode()


# -- issue 20, case 10 (warm's part): the dense alignment is named when it shapes the verdict ----


def test_dense_resumed_verdict_names_the_alignment(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    text = "".join(f"Rule {i}: keep functions short and names plain.\n" for i in range(540))
    reg.add(text, name="dense")
    with SimServer(SimConfig.for_profile("dense", speed=500)) as sim:
        res = run_cli("warm", "dense", "--worker", sim.url, "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    body = orjson.loads(res.stdout)["body"]
    # ~5,900 tokens: the engine caches 4,096 (two 2,048-token units), which the template
    # allowance alone would call partial; the verdict says the alignment is why it is not.
    assert body["alignment"] == 2048 and body["cached_tokens"] == 4096, body
    assert body["span_tokens"] - body["cached_tokens"] > 32, body
    assert body["verdict"] == "resumed" and "multiples of 2,048 tokens" in body["reason"], body


# -- a label never says more than its numbers: the span's source, the rest, the caller's types --


def test_without_the_rest_of_the_prompt_the_share_is_not_guessed() -> None:
    # 4,000 prompt tokens, 2,000 cached: a 6,000-byte head with a long history is resumed,
    # the same head alone would be partial; not knowing which, the judge says unverified.
    ev = evidence(4000, 2000)
    assert judge(ev, head_bytes=6000, rest_bytes=6000).verdict == "resumed"
    assert judge(ev, head_bytes=6000, rest_bytes=0).verdict == "partial"
    unknown = judge(ev, head_bytes=6000)
    assert unknown.verdict == "unverified" and "rest_bytes" in unknown.reason
    assert judge(ev, head_bytes=6000, measured_span=2010).verdict == "resumed"  # measured: known
    assert judge(evidence(4000, 0), head_bytes=6000).verdict == "cold"  # nothing cached is cold


def test_rest_bytes_reads_the_messages_after_the_head() -> None:
    from prefixreg.core.prefix import Prefix, rest_bytes

    head = Prefix.from_text("0" * 64, "system")
    body = head.body([{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "ok"}])
    assert rest_bytes(body) == len("user") + len("héllo".encode()) + len("assistant") + len("ok")
    deep: Any = "x"
    for _ in range(10_000):  # any depth: read without recursion
        deep = [deep]
    assert rest_bytes({"messages": [{}, {"role": "user", "content": deep}]}) == 5
    bad: object
    for bad in (None, [], {"messages": "x"}):
        with pytest.raises(UsageError):
            rest_bytes(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"head_bytes": True}, "head_bytes"),
        ({"head_bytes": "100"}, "head_bytes"),
        ({"head_bytes": None}, "head_bytes"),
        ({"head_bytes": -1}, "head_bytes"),
        ({"head_bytes": 100, "rest_bytes": 1.5}, "rest_bytes"),
        ({"head_bytes": 100, "measured_span": True}, "measured_span"),
        ({"head_bytes": 100, "measured_span": "90"}, "measured_span"),
        ({"head_bytes": 100, "alignment": None}, "alignment"),
        ({"head_bytes": 100, "tools_tokens": -3}, "tools_tokens"),
    ],
)
def test_the_judge_refuses_a_wrong_type_instead_of_judging_it(
    kwargs: dict[str, Any], needle: str
) -> None:
    with pytest.raises(UsageError, match=needle):
        judge(evidence(100, 90), **kwargs)


def test_every_judge_function_refuses_the_wrong_types() -> None:
    resumed = Judgement("resumed", "covered", span=100, coverage=1.0)
    with pytest.raises(UsageError):
        judge({"prompt_tokens": 5}, head_bytes=10, rest_bytes=0)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        judge_unknown_head(None, "why")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        judge_resident(None, 0)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        judge_resident(resumed, -1)
    with pytest.raises(UsageError):
        judge_restore(None, 10, "resumed")  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        judge_copy("no", 1)  # type: ignore[arg-type]
    assert judge_copy(True, True) == "verified"


def test_a_measured_span_is_what_the_server_counted_never_an_estimate(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add("You are a careful coding agent. Keep the repository's conventions.\n" * 60, name="p")
    with SimServer(SimConfig(speed=5000)) as sim:
        first = warm_json(reg, sim.url)
        second = warm_json(reg, sim.url)
    # The first warm has nothing measured: its span is the byte estimate, and says so.
    assert first["verdict"] == "resumed" and first["span_source"] == "estimated", first
    assert "(estimated span" in first["reason"]
    # The second reads the span the server counted on the first's resumed check.
    assert second["span_source"] == "measured" and second["span_tokens"] == first["cached_tokens"]
    assert f"(measured span {first['cached_tokens']:,})" in second["reason"]


def test_on_an_aligned_engine_a_cached_count_measures_no_span(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    text = "".join(f"Rule {i}: keep functions short and names plain.\n" for i in range(540))
    reg.add(text, name="p")
    with SimServer(SimConfig.for_profile("dense", speed=500)) as sim:
        bodies = [warm_json(reg, sim.url) for _ in range(2)]
    # Dense rounds cached counts down to 2,048: both warms estimate, and name the alignment.
    for body in bodies:
        assert body["verdict"] == "resumed" and body["span_source"] == "estimated", body
        assert "multiples of 2,048 tokens" in body["reason"], body


def warm_json(reg: Registry, url: str) -> dict[str, Any]:
    res = run_cli("warm", "p", "--worker", url, "--registry", str(reg.root), "--json")
    assert res.returncode == 0, res.stderr
    body: dict[str, Any] = orjson.loads(res.stdout)["body"]
    return body


def test_the_labels_other_verbs_gave_themselves_come_from_the_judge() -> None:
    # warm --no-check, a build change during a measurement, a probe's survival.
    assert judge_warm_only(evidence(100, 0))[0] == "warmed"
    assert judge_warm_only(evidence(None, None))[0] == "unverified"
    assert judge_same_build("a" * 16, "a" * 16) is None
    changed = judge_same_build("a" * 16, "b" * 16)
    assert changed is not None and changed.verdict == "unverified"
    assert "build changed" in changed.reason and "b" * 16 in changed.reason
    assert judge_unproven("no check was made") == Judgement("unverified", "no check was made")
    assert judge_survival(False, None) is None
    assert (judge_survival(True, 7), judge_survival(True, None)) == ("verified", "unverified")


def test_a_call_judged_without_its_body_is_never_resumed() -> None:
    from prefixreg.core.judge import Judgement, judge_without_body

    resumed = Judgement("resumed", "2,755 of 2,769 cached", 2755, "measured", 1.0, 0, 2769, 2755)
    j = judge_without_body(resumed, "frame abc")
    assert j.verdict == "unverified" and "no request body to check" in j.reason
    assert "frame abc" in j.reason and j.cached_tokens == 2755
    assert judge_without_body(Judgement("partial", "p", 10), "x").verdict == "unverified"
    cold = Judgement("cold", "0 of 100 cached", None, None, None, 0, 100, 0)
    assert judge_without_body(cold, "x") is cold  # nothing resumed: cold stands
    with pytest.raises(UsageError):
        judge_without_body("resumed", "x")  # type: ignore[arg-type]

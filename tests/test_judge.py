"""The one judge (`prefixreg.core.judge`): properties over any counts, and issue 20's cases
that belong to warm (implausible counts, per-call labels, the alignment named).

Real loopback servers only: the simulator and `tests/fakeserver.py`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from prefixreg.core.judge import (
    MAX_BYTES_PER_TOKEN,
    Judgement,
    allowance,
    judge,
    judge_copy,
    judge_resident,
    judge_restore,
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
    j = judge(evidence(prompt, prompt), head_bytes=head)
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
    text = "".join(f"Rule {i}: keep functions short and names plain.\n" for i in range(180))
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

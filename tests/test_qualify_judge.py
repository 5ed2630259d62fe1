"""`qualify`'s judging, pure: fingerprint comparisons, decode rate and the `qualified` rule,
over evidence parsed from real stream bodies (`evidence_from_response`), never built by hand
where a parser decides."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from prefixreg.core.errors import UsageError
from prefixreg.core.judge import Assertions, compare_output, compare_tokens, judge_qualified
from prefixreg.core.qualification import decode_rate
from prefixreg.core.records import CallEvidence
from prefixreg.server.evidence import evidence_from_response
from prefixreg.server.sse import SSEParser
from tests.fakeserver import sse_frames

SHA_A, SHA_B = "a" * 12, "b" * 64


def stream(
    pieces: list[str] | None = None,
    *,
    cached: Any = 0,
    prompt: Any = 8,
    completion: Any = 4,
    token_sha: Any = None,
    done: bool = True,
    reasoning: list[str] | None = None,
) -> CallEvidence:
    """Evidence of a completions stream with these pieces and a final usage frame."""
    frames: list[object] = [
        {"choices": [{"index": 0, "text": p, "finish_reason": None}]} for p in pieces or ["hi"]
    ]
    frames += [
        {"choices": [{"index": 0, "delta": {"reasoning_content": r}, "finish_reason": None}]}
        for r in reasoning or []
    ]
    usage = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    last: dict[str, Any] = {"choices": [], "usage": usage}
    if token_sha is not None:
        last["tensorfold"] = {"token_sha": token_sha}
    body = b"".join(sse_frames([*frames, last], done=done))
    return evidence_from_response(body, wall_s=1.0, ttft_s=0.25)


def test_cold_and_reused_need_affirmative_counts() -> None:
    assert stream(cached=0).cache_state == "cold"
    assert stream(cached=7).cache_state == "reused"
    for cached in (None, -1, False, True, "0", 0.0, 9):
        assert stream(cached=cached).cache_state == "unverified", cached
    for prompt in (None, -1, True, "8", 8.0):
        assert stream(prompt=prompt).cache_state == "unverified", prompt
    assert stream(cached=0, done=False).cache_state == "unverified"


def test_a_missing_token_hash_on_either_side_is_unverified_never_a_pass() -> None:
    with_a = stream(token_sha=SHA_A)
    without = stream()
    assert compare_tokens(with_a, without) == "unverified"
    assert compare_tokens(without, with_a) == "unverified"
    assert compare_tokens(without, without) == "unverified"  # equal text proves no tokens
    assert compare_output(without, without) == "pass"
    assert compare_tokens(with_a, stream(token_sha=SHA_A)) == "pass"
    assert compare_tokens(with_a, stream(token_sha=SHA_B)) == "differ"
    for bad in (True, 11, "not-a-hash", "a" * 11, "A" * 12):
        assert compare_tokens(with_a, stream(token_sha=bad)) == "unverified", bad
    truncated = stream(token_sha=SHA_A, done=False)
    assert compare_tokens(with_a, truncated) == "unverified"
    assert compare_output(with_a, truncated) == "unverified"
    errored = replace(stream(token_sha=SHA_A), error="server_stream_error")
    assert compare_tokens(with_a, errored) == "unverified"


def test_output_fingerprint_ignores_chunks_and_tells_reasoning_from_content() -> None:
    whole = stream(["café 🚀"])
    split = stream(["caf", "é ", "🚀"])
    assert whole.output_sha256 == split.output_sha256
    assert compare_output(whole, split) == "pass"
    swapped = stream([""], reasoning=["café 🚀"])
    assert compare_output(whole, swapped) == "differ"
    reasoning_only = stream([""], reasoning=["thinking"])
    assert reasoning_only.complete and reasoning_only.output_sha256 is not None


def test_unicode_split_inside_a_character_across_wire_pieces() -> None:
    frame = {"choices": [{"index": 0, "text": "café 🚀", "finish_reason": None}]}
    raw = "data: " + json.dumps(frame, ensure_ascii=False) + "\n\n"  # UTF-8 on the wire
    body = b"".join(sse_frames([raw, {"choices": [], "usage": {"prompt_tokens": 3}}]))
    cut = body.index("🚀".encode()) + 2  # inside the 4-byte character
    parser = SSEParser()
    parser.feed(body[:cut])
    parser.feed(body[cut:])
    expected = stream(["café 🚀"]).output_sha256
    assert evidence_from_response(parser.finish()).output_sha256 == expected


def test_decode_rate_only_for_complete_replies_with_tokens_and_times() -> None:
    ev = stream(completion=5)
    assert decode_rate(ev) == pytest.approx(4 / 0.75)
    assert decode_rate(stream(completion=1)) is None
    assert decode_rate(stream(completion=None)) is None
    assert decode_rate(stream(done=False)) is None
    assert decode_rate(replace(ev, ttft_s=None)) is None
    assert decode_rate(replace(ev, wall_s=0.25)) is None


def rows(first: CallEvidence, *rest: tuple[str, CallEvidence]) -> list[tuple[str, CallEvidence]]:
    return [("first", first), *rest]


def test_qualified_fails_closed_on_missing_evidence_and_wrong_counts() -> None:
    cold, reused = stream(cached=0), stream(cached=7)
    plain = Assertions()
    assert judge_qualified(rows(cold, ("repeated", reused)), plain) == (True, ())
    assert judge_qualified([], plain)[0] is False
    assert judge_qualified([("repeated", cold)], plain)[0] is False
    ok, why = judge_qualified(rows(cold), Assertions(expected_prompt_tokens=9))
    assert not ok and "reported 8 prompt tokens, expected 9" in why[0]
    assert judge_qualified(rows(cold), Assertions(expected_prompt_tokens=8))[0]
    assert not judge_qualified(rows(stream(cached=None)), Assertions(require_cold=True))[0]
    assert not judge_qualified(rows(reused), Assertions(require_cold=True))[0]
    reuse = Assertions(require_reuse=True)
    assert not judge_qualified(rows(cold, ("repeated", cold)), reuse)[0]
    assert judge_qualified(rows(cold, ("repeated", reused), ("concurrent", cold)), reuse)[0]
    ok, why = judge_qualified(rows(cold, ("repeated", stream(["other"]))), plain)
    assert not ok and "output fingerprint differs" in why[0]
    ok, why = judge_qualified(rows(stream(completion=0)), plain)
    assert not ok and "0 completion tokens" in why[0]
    assert not judge_qualified(rows(cold, ("repeated", stream(done=False))), plain)[0]
    # tokens unverified (no hash anywhere) does not fail the run: it is said, not passed
    assert judge_qualified(rows(cold, ("repeated", cold)), plain)[0]
    ok, why = judge_qualified(
        rows(stream(token_sha=SHA_A), ("repeated", stream(token_sha=SHA_B))), plain
    )
    assert not ok and "token fingerprint differs" in why[0]


@pytest.mark.parametrize(
    "kwargs",
    [{"require_cold": 1}, {"expected_prompt_tokens": 0}, {"expected_prompt_tokens": True}],
)
def test_assertions_refuse_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        Assertions(**kwargs)


def test_comparisons_refuse_what_is_not_evidence() -> None:
    with pytest.raises(UsageError):
        compare_tokens({}, stream())  # type: ignore[arg-type]

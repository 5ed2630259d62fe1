"""The judge's part for `qualify`: fingerprint comparisons and the `qualified` decision. Pure.

`core.judge` owns these (and re-exports them): every label `qualify` prints comes from here,
from the server's own numbers (halogen-api.md §3.4-§3.8, the strict benchmark rules).

Invariants:
- A comparison is `pass`, `differ` or `unverified`. The token comparison reads `token_sha`
  only: it is `unverified` when either call is incomplete, failed, or lacks a token hash
  (one side or both), never a pass; output text equality never stands in for it. The
  output comparison reads `output_sha256` only (absent for an incomplete call: unverified).
- `qualified` holds only when there is a first call, every call completed with a nonzero
  server-counted completion and some output text (content or reasoning), every asked
  assertion held (`--require-cold` on the first call, `--require-reuse` on every repeated
  call, `--expected-prompt-tokens` on every call's server-reported prompt count), and no
  comparison `differ`ed. Concurrent calls are judged
  per call and are never asserted cold or reused. Each failure is named in words.
- A decode rate is (completion - 1) / (wall - ttft): only for a complete call with more
  than one token, a first-token time and a wall time after it; else None (never a guess).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.digest import output_digest
from prefixreg.core.errors import ArgumentTypeError, ArgumentValueError
from prefixreg.core.records import CallEvidence

Comparison = Literal["pass", "differ", "unverified"]
Phase = Literal["first", "repeated", "concurrent"]
PHASES: Final[tuple[Phase, ...]] = ("first", "repeated", "concurrent")
NO_OUTPUT: Final = output_digest(b"", b"")  # the fingerprint of a reply with no text at all


def _evidence(value: object, what: str) -> CallEvidence:
    if not isinstance(value, CallEvidence):
        raise ArgumentTypeError(f"{what} must be a CallEvidence, not {type(value).__name__}")
    return value


def compare_tokens(first: CallEvidence, other: CallEvidence) -> Comparison:
    """`other`'s token fingerprint against `first`'s: `unverified` unless both calls are
    complete, without error, and each reported a `token_sha`."""
    a, b = _evidence(first, "first"), _evidence(other, "other")
    usable = all(e.complete and e.error is None and e.token_sha for e in (a, b))
    if not usable:
        return "unverified"
    return "pass" if a.token_sha == b.token_sha else "differ"


def compare_output(first: CallEvidence, other: CallEvidence) -> Comparison:
    """`other`'s output fingerprint (`output_sha256`) against `first`'s: `unverified` when
    either is absent (an incomplete call has none)."""
    a, b = _evidence(first, "first"), _evidence(other, "other")
    if a.output_sha256 is None or b.output_sha256 is None:
        return "unverified"
    return "pass" if a.output_sha256 == b.output_sha256 else "differ"


def decode_rate(evidence: CallEvidence) -> float | None:
    """Tokens per second after the first (module docstring), or None."""
    ev = _evidence(evidence, "evidence")
    k, ttft, wall = ev.completion_tokens, ev.ttft_s, ev.wall_s
    if not ev.complete or k is None or k < 2 or ttft is None or wall is None or wall <= ttft:
        return None
    return (k - 1) / (wall - ttft)


@dataclass(frozen=True, slots=True, kw_only=True)
class Assertions:
    """What a run was asked to prove, beyond completing: see the module docstring."""

    require_cold: bool = False
    require_reuse: bool = False
    expected_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("require_cold", "require_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentTypeError(f"{name} must be True or False")
        n = self.expected_prompt_tokens
        if n is not None and (type(n) is not int or n < 1):
            kind = ArgumentTypeError if type(n) is not int else ArgumentValueError
            raise kind(f"expected_prompt_tokens must be a whole number >= 1, not {n!r:.20}")


def judge_qualified(
    calls: Sequence[tuple[str, CallEvidence]], assertions: Assertions
) -> tuple[bool, tuple[str, ...]]:
    """(qualified, each failure in words) over the calls in request order, each `(phase,
    evidence)`; the first call's phase is `first`."""
    if not isinstance(assertions, Assertions):
        raise ArgumentTypeError(
            f"assertions must be an Assertions, not {type(assertions).__name__}"
        )
    rows = [(str(phase), _evidence(ev, "evidence")) for phase, ev in calls]
    if not rows or rows[0][0] != "first":
        return False, ("no first request was measured",)
    failures: list[str] = []
    first = rows[0][1]
    expected = assertions.expected_prompt_tokens
    for index, (phase, ev) in enumerate(rows):
        who = f"request {index + 1} ({phase})"
        if ev.error is not None or not ev.complete:
            failures.append(f"{who} did not complete ({ev.error or 'incomplete'})")
        elif not ev.completion_tokens:
            counted = "no" if ev.completion_tokens is None else "0"
            failures.append(f"{who}: the server counted {counted} completion tokens")
        elif ev.output_sha256 == NO_OUTPUT:
            failures.append(f"{who}: the reply had no output text (content or reasoning)")
        if expected is not None and ev.prompt_tokens != expected:
            seen = "none" if ev.prompt_tokens is None else f"{ev.prompt_tokens:,}"
            failures.append(
                f"{who}: the server reported {seen} prompt tokens, expected {expected:,}"
            )
        if assertions.require_cold and index == 0 and ev.cache_state != "cold":
            failures.append(f"{who} is not cold ({_state(ev)}): --require-cold")
        if assertions.require_reuse and phase == "repeated" and ev.cache_state != "reused":
            failures.append(f"{who} did not reuse ({_state(ev)}): --require-reuse")
        if index:
            for what, outcome in (
                ("token", compare_tokens(first, ev)),
                ("output", compare_output(first, ev)),
            ):
                if outcome == "differ":
                    failures.append(f"{who}: its {what} fingerprint differs from the first's")
    return not failures, tuple(failures)


def _state(ev: CallEvidence) -> str:
    if ev.cache_state == "unverified":
        return f"unverified: {ev.reason or 'no counts'}"
    cached = "-" if ev.cached_tokens is None else f"{ev.cached_tokens:,}"
    return f"{ev.cache_state}, {cached} cached"

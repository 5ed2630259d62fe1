"""The judge: the one place a verdict is decided, from the server's own numbers. Pure.

Every label prefixreg prints (warm's headline, keepalive's kept, audit's reused, a loop's
resumed, pool's resident, snapshot's restored, mirror's verified) comes from here; no other
module compares a cached count with a span.

The rule, stated once (the README's evidence section quotes it):

    A call *resumed* a head only when the server reported, for a complete call, a prompt
    count plausible for the head's bytes and a cached count that covers the head's span
    less the engine's allowance. The span is the head's measured span on this build when
    there is one, else an estimate: its share of the prompt by bytes, never more tokens
    than it has bytes. The allowance is the engine's alignment plus 32 template tokens,
    never more than half the span. Less is *partial*, zero is *cold*, and anything the
    numbers cannot carry (a count missing or malformed, cached > prompt, fewer prompt
    tokens than the bytes allow, no span to compare with) is *unverified*, with the reason.

Invariants:
- `resumed` implies: evidence complete, counts valid, `prompt >= min_tokens(head_bytes)`,
  `cached <= prompt` and `cached >= span - allowance(span, alignment)` with `span >= 1`.
- When the alignment, not the template allowance, is what lets a count pass, the reason
  names the alignment ("the server caches in multiples of 2,048 tokens").
- `qualify`'s fingerprint comparisons and its `qualified` decision live in the module this
  one owns, `core.qualification` (re-exported here): a missing token hash is never a pass.
  The verdicts on a worker's reach and a batch's lever (doctor's fit and "urgent", audit's
  "the lever") live in the other, `core.levers`, on this module's allowance.
- `restored` needs a baseline showing the slot did not hold the head, a restore that
  loaded tokens, and a resumed pinned check; `resident` needs a resumed proof that nothing
  touched the worker after; `verified` (a copy) needs its bytes hashed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.core.jsonio import JSONObject
from prefixreg.core.qualification import Assertions as Assertions
from prefixreg.core.qualification import compare_output as compare_output
from prefixreg.core.qualification import compare_tokens as compare_tokens
from prefixreg.core.qualification import judge_qualified as judge_qualified
from prefixreg.core.records import CallEvidence, Measurement

Verdict = Literal["resumed", "partial", "cold", "unverified"]
RestoreVerdict = Literal["restored", "resident", "not_restored", "unverified"]
CopyVerdict = Literal["verified", "unchecked", "mismatch"]
FitVerdict = Literal["fits", "not_proven", "does_not_fit", "unverified"]
Source = Literal["measured", "estimated"] | None

# Template tokens around the system message that a byte-share estimate cannot see.
TEMPLATE_ALLOWANCE: Final = 32
# The allowance never takes more than this share of the span: a head whose cached count
# covers less than half of it was not resumed, whatever its size.
ALLOWANCE_SHARE: Final = 0.5
# No tokenizer in use packs more bytes than this into one token (the longest merges are
# runs of spaces or punctuation, well under it); fewer prompt tokens than
# `bytes / MAX_BYTES_PER_TOKEN` cannot be a count of those bytes.
MAX_BYTES_PER_TOKEN: Final = 128


def check_counts(*, least: int | None = 0, **values: object) -> None:
    """`UsageError` unless each value is a whole number (None passes: not known) of at least
    `least` (None: any; a span or alignment below 1 means none and is judged so)."""
    for what, value in values.items():
        if value is not None and (type(value) is not int or (least is not None and value < least)):
            raise UsageError(f"{what} must be a whole number >= {least or 0}, not {value!r:.40}")


def _evidence(value: object) -> CallEvidence:
    if not isinstance(value, CallEvidence):
        raise UsageError(f"the judge reads a CallEvidence, not {type(value).__name__}")
    return value


def _judgement(value: object, what: str) -> Judgement:
    if not isinstance(value, Judgement):
        raise UsageError(f"{what} must be a Judgement, not {type(value).__name__}")
    return value


def allowance(span: int, alignment: int) -> int:
    """Tokens a cached count may fall short of `span` and still count as covering it."""
    if span <= 0:
        return 0
    return min(max(alignment, 0) + TEMPLATE_ALLOWANCE, math.floor(span * ALLOWANCE_SHARE))


def min_tokens(head_bytes: int) -> int:
    """The fewest prompt tokens a prompt holding `head_bytes` bytes can plausibly have."""
    return math.ceil(max(head_bytes, 0) / MAX_BYTES_PER_TOKEN)


def estimate_span(prompt_tokens: int, head_bytes: int, rest_bytes: int) -> int:
    """The head's share of `prompt_tokens` by bytes, never more tokens than it has bytes."""
    total = head_bytes + rest_bytes
    if total <= 0 or head_bytes <= 0:
        return 0
    return min(math.floor(prompt_tokens * head_bytes / total), head_bytes)


@dataclass(frozen=True, slots=True)
class Judgement:
    """A verdict on one call against one head, with the numbers it stands on."""

    verdict: Verdict
    reason: str
    span: int | None = None
    span_source: Source = None
    coverage: float | None = None
    alignment: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def resumed(self) -> bool:
        return self.verdict == "resumed"

    def to_dict(self) -> JSONObject:
        return {
            "verdict": self.verdict,
            "reason": self.reason,
            "span_tokens": self.span,
            "span_source": self.span_source,
            "coverage": self.coverage,
            "alignment": self.alignment,
        }


def judge(
    evidence: CallEvidence,
    *,
    head_bytes: int,
    rest_bytes: int | None = None,
    alignment: int = 0,
    measured_span: int | None = None,
    tools_tokens: int | None = None,
    confirmed_span: int | None = None,
) -> Judgement:
    """Did this call resume the head (`head_bytes`, then `rest_bytes` of other content: None
    when not known, e.g. `prefix.rest_bytes(body)`)? `measured_span`: the head's span the
    server counted on a resumed check of this build; `tools_tokens`: what the frame's tools
    add to the prompt (0: the template drops them, never resumed); `confirmed_span`: with
    neither a measured span nor `rest_bytes`, an estimated span a resumed check of this build
    covered (an aligned engine's, whose counts measure none), judged as an estimate. Raises
    UsageError: an argument of the wrong type, or a count below 0."""
    check_counts(head_bytes=head_bytes, rest_bytes=rest_bytes, tools_tokens=tools_tokens)
    check_counts(least=None, alignment=alignment, measured_span=measured_span)
    check_counts(least=None, confirmed_span=confirmed_span)
    given: tuple[object, object] = (head_bytes, alignment)  # callers outside the type checker
    if None in given:
        raise UsageError("head_bytes and alignment must be whole numbers, not None")
    prompt, cached = _evidence(evidence).prompt_tokens, evidence.cached_tokens
    if evidence.cache_state == "unverified" or prompt is None or cached is None:
        why = evidence.reason or "the server did not report prompt and cached counts"
        return Judgement("unverified", why, alignment=alignment)

    def out(
        verdict: Verdict, why: str, span: int | None = None, source: Source = None
    ) -> Judgement:
        coverage = min(1.0, cached / span) if span else None
        return Judgement(verdict, why, span, source, coverage, alignment, prompt, cached)

    if cached > prompt:
        return out("unverified", "cached_tokens > prompt_tokens")
    floor = min_tokens(head_bytes)
    if prompt < floor:
        return out(
            "unverified",
            f"{prompt:,} prompt tokens cannot hold a head of {head_bytes:,} bytes (at least "
            f"{floor:,} at {MAX_BYTES_PER_TOKEN} bytes per token): the counts are not of this "
            "prompt",
        )
    source: Source
    if measured_span is not None and 0 < measured_span <= prompt:
        span, source = measured_span, "measured"
    elif rest_bytes is not None:
        span, source = estimate_span(prompt, head_bytes, rest_bytes), "estimated"
    elif confirmed_span is not None and 0 < confirmed_span <= prompt:
        span, source = confirmed_span, "estimated"
    elif cached == 0:
        return out("cold", f"0 of {prompt:,} prompt tokens cached")  # whatever the head's span
    else:
        why = "no span of this build to use"  # none given, or one longer than the prompt
        why += ", and the prompt's bytes beyond the head are not known (rest_bytes)"
        return out("unverified", f"{why}: the head's share of the prompt cannot be estimated")
    if span <= 0:
        return out("unverified", "no head span to compare the cached count with")
    if cached == 0:
        return out("cold", f"0 of {prompt:,} prompt tokens cached", span, source)
    if tools_tokens == 0:  # whatever it covers: a span with the tools' share is no measure
        why = (
            f"{cached:,} cached, but the frame's tools add no prompt tokens on this server "
            "(its chat template drops them): the tools the loop sends were never part of "
            "what was warmed"
        )
        return out("unverified", why, span, source)
    short = span - cached
    if short > allowance(span, alignment):
        why = f"{cached:,} cached tokens, short of the head's {source} span of {span:,}"
        return out("partial", why, span, source)
    why = f"{cached:,} of {prompt:,} prompt tokens came from the cache ({source} span {span:,})"
    if short > allowance(span, 0):
        why += (
            f"; the server caches in multiples of {alignment:,} tokens, and the rest is under one"
        )
    return out("resumed", why, span, source)


def counted_span(m: Measurement) -> int | None:
    """The head's span as the server counted it, from a measured check: the cached count of
    a resumed fresh-tail check, on an engine that counts cached tokens one by one. None when
    nothing was measured: a check not resumed, or an aligned engine (its count is rounded
    down to the alignment: a lower bound, no measure of the span)."""
    o = m.outcome
    align = m.build.snapshot_align if o.alignment is None else o.alignment
    checked = o.phases[-1:] == ("check",)  # not a re-warm of a session, not a probe leg
    if not checked or o.verdict != "resumed" or not o.cached_tokens or align > 1:
        return None
    return o.cached_tokens


def judge_warm_only(evidence: CallEvidence) -> tuple[Literal["warmed", "unverified"], str]:
    """A warm call sent with no resume check: `warmed` when the server counted it (complete,
    valid counts), else `unverified`; it proves nothing about resuming either way."""
    if _evidence(evidence).cache_state == "unverified":
        return "unverified", evidence.reason or "the server did not report prompt and cached counts"
    return "warmed", "warm call completed with verified counts"


def judge_same_build(before: str, after: str) -> Judgement | None:
    """None when a measurement began and ended on one server build; else `unverified`: its
    numbers were counted across a change of build and prove nothing about either."""
    if before == after:
        return None
    return Judgement(
        "unverified", f"the server build changed during the measurement ({before} -> {after})"
    )


def judge_unproven(why: str) -> Judgement:
    """A claim with no numbers to stand on (no check was made, a reply did not count what
    it did): `unverified`, saying why."""
    return Judgement("unverified", why)


def judge_survival(
    searched: bool, survival: int | None
) -> Literal["verified", "unverified"] | None:
    """A probe's survival (foreign prompts a head outlives): `verified` when its search ended
    on the server's counts, `unverified` when it could not; None when not searched."""
    if not searched:
        return None
    return "unverified" if survival is None else "verified"


def judge_unknown_head(evidence: CallEvidence, why: str) -> Judgement:
    """A call whose head is unknown (a response without its request): `cold` when nothing of
    a counted prompt was cached, else `unverified` with `why`; never resumed nor partial."""
    prompt, cached = _evidence(evidence).prompt_tokens, evidence.cached_tokens
    if evidence.cache_state == "unverified" or prompt is None or cached is None:
        why = evidence.reason or "the server did not report prompt and cached counts"
        return Judgement("unverified", why)
    verdict: Verdict = "cold" if cached == 0 else "unverified"
    if cached > prompt:
        verdict, why = "unverified", "cached_tokens > prompt_tokens"
    elif cached == 0:
        why = f"0 of {prompt:,} prompt tokens cached"
    return Judgement(verdict, why, prompt_tokens=prompt, cached_tokens=cached)


def judge_restore(
    baseline: Judgement | None, n_restored: int | None, check: Judgement
) -> tuple[RestoreVerdict, str]:
    """A restore into a slot: `baseline`, a pinned check before (None: the slot was erased),
    `n_restored` the server's count, `check` the pinned check after; `restored` when all agree."""
    _judgement(check, "check")
    check_counts(n_restored=n_restored)
    if baseline is not None and _judgement(baseline, "baseline").resumed:
        return "resident", "the slot held the head before the restore: the restore proved nothing"
    if baseline is not None and baseline.verdict == "unverified":
        return "unverified", f"no baseline of the slot: {baseline.reason}"
    if not n_restored:
        return "not_restored", f"the server restored {n_restored} tokens"
    if check.resumed:
        return "restored", f"{n_restored:,} tokens restored; {check.reason}"
    if check.verdict == "unverified":
        return "unverified", check.reason
    why = f"the restored slot did not resume the head ({check.verdict}: {check.reason})"
    return "not_restored", why


def judge_without_body(j: Judgement, head: str) -> Judgement:
    """A loop call judged with no request body to check (`head`: the head it was judged
    against, named): its counts may cover the head's span, but nothing shows the call sent
    that head unchanged (another system prompt, tools or settings can resume as many tokens),
    so a resumed or partial verdict is unverified, with why; cold and unverified stand."""
    if _judgement(j, "judgement").verdict not in ("resumed", "partial"):
        return j
    why = f"no request body to check that the call sent {head} unchanged (counts alone: "
    why += f"{j.verdict}, {j.reason}); pass the body the loop sent"
    return Judgement(
        "unverified",
        why,
        j.span,
        j.span_source,
        j.coverage,
        j.alignment,
        j.prompt_tokens,
        j.cached_tokens,
    )


def judge_resident(proof: Judgement, touched_after: int) -> tuple[bool, str]:
    """Is a head resident on a worker? Only when its proof resumed and no prefill touched
    the worker after the proof (`touched_after` calls did)."""
    check_counts(touched_after=touched_after)
    if not _judgement(proof, "proof").resumed:
        return False, f"{proof.verdict}: {proof.reason}"
    if touched_after:
        return False, f"{touched_after} later prefill(s) on this worker make the proof stale"
    return True, proof.reason


def judge_burst(
    verdict: Verdict, *, first: bool, landed: float | None, survives: float, unit: str
) -> bool:
    """Did a burst of foreign prompts fill the cache between two polls, so that only more
    cache entries can keep the head (polling sooner cannot)? Only when a re-warm of a head
    that was warm (not its first) came back cold or partial and the foreign activity counted
    between the previous poll and this one (`landed`) alone reached what a head survives
    (`survives`, in the same counted `unit`; seconds count no prompts: never)."""
    if unit == "seconds" or first or landed is None or verdict not in ("cold", "partial"):
        return False
    return landed >= survives


def judge_copy(hashed: bool, matched: bool | None) -> CopyVerdict:
    """A copied file is `verified` only when its bytes were hashed and matched."""
    given: tuple[object, object] = (hashed, matched)  # callers outside the type checker
    if not isinstance(given[0], bool) or not isinstance(given[1], bool | None):
        raise UsageError(f"judge_copy takes booleans, not {hashed!r:.20} and {matched!r:.20}")
    if not hashed or matched is None:
        return "unchecked"
    return "verified" if matched else "mismatch"


def alignment_shaped(j: Judgement) -> bool:
    """Whether the engine's alignment, not the template allowance, let `j` pass as resumed:
    a label of it must then name the alignment."""
    if not j.resumed or j.span is None or j.cached_tokens is None:
        return False
    return j.span - j.cached_tokens > allowance(j.span, 0)

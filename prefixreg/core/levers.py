"""The judge's verdicts a user acts on about capacity and where tokens went: does a head fit
one cache entry (`judge_fit`), does an entry reach past a loop's system prompt or is it
urgent (`judge_reach`), and is prompt caching the lever for a batch (`judge_lever`). Pure;
part of the one judge (`core.judge`, whose allowance they use).

Invariants:
- `fits` only when a probe's Cmax covers the span less the allowance; a lower bound (every
  size resumed) is `not_proven`, never `does_not_fit`.
- `urgent` only when the top of the bracket of Cmax is at most `URGENT_CMAX`: never on a
  bound the probe's chosen sizes set.
- `lever` only when the tokens a cache could have held (head drift and misses, the session's
  lost prefix) are at least the newly appended history; from token counts, never time.
"""

from __future__ import annotations

from typing import Final, Literal

from prefixreg.core.errors import ArgumentTypeError
from prefixreg.core.judge import FitVerdict, allowance, check_counts


def judge_fit(
    span: int, cmax: int, *, lower_bound: bool, alignment: int = 0
) -> tuple[FitVerdict, str]:
    """Does a head of `span` tokens fit in one cache entry? `cmax`: a probe's largest fresh-tail
    cached count on this build (`lower_bound`: every size probed resumed whole). It `fits`
    only when `cmax` covers the span less the allowance; else a lower bound is `not_proven`."""
    check_counts(least=None, alignment=alignment)
    if type(span) is not int or type(cmax) is not int:
        raise ArgumentTypeError(f"judge_fit takes whole numbers, not {span!r:.20} and {cmax!r:.20}")
    if span < 1 or cmax < 0:
        return "unverified", "no span or Cmax to compare"
    short = span - cmax
    aligned = f"the server's {alignment:,}-token alignment"
    if short <= allowance(span, alignment):
        why = f"Cmax {cmax:,} covers its span of {span:,} tokens"
        return "fits", why + (f", within {aligned}" if short > allowance(span, 0) else "")
    if lower_bound:
        why = f"its {span:,} tokens are more than the largest size the probe resumed"
        return "not_proven", why + f" (Cmax at least {cmax:,})"
    why = f"a fresh call resumes at most {cmax:,} of its {span:,} tokens"
    return "does_not_fit", why + (f", short by more than {aligned}" if alignment > 1 else "")


ReachVerdict = Literal["urgent", "not_proven", "reaches"]
# Below this many tokens one cache entry does not reach past a loop's system prompt.
URGENT_CMAX: Final = 4000


def judge_reach(low: int, below: int | None) -> tuple[ReachVerdict, str]:
    """How far one cache entry reaches, from a probe's bracket of Cmax: at least `low` (the
    largest count a fresh tail resumed), under `below` (the span of the first larger size that
    did not resume; None: no ceiling). `urgent` only when the top is at most `URGENT_CMAX`;
    `reaches` when the bottom is at least that; else `not_proven` (a finer probe decides)."""
    for name, value in (("low", low), ("below", below)):
        if type(value) is not int and not (name == "below" and value is None):
            raise ArgumentTypeError(f"judge_reach: {name} is a whole number, not {value!r:.40}")
    check_counts(low=low, below=below)
    said = f"Cmax is at least {low:,}" + ("" if below is None else f" and below {below:,}")
    if below is not None and below <= URGENT_CMAX:
        return "urgent", f"Cmax is under {below:,} tokens (at least {low:,}), below {URGENT_CMAX:,}"
    if low >= URGENT_CMAX:
        return "reaches", f"{said} tokens"
    why = "no larger size was probed" if below is None else "the probe's sizes are too far apart"
    return "not_proven", f"{said} tokens: whether it reaches {URGENT_CMAX:,} is not known ({why})"


LeverVerdict = Literal["lever", "not_lever", "unverified"]


def judge_lever(
    *,
    cached: int,
    new_history: int,
    drift: int,
    miss: int,
    unknown: int = 0,
    session: int = 0,
    unmatched: int = 0,
) -> tuple[LeverVerdict, str]:
    """Is prompt caching the lever for a batch? From where its prompt tokens went, never time.
    A cache could have held the head's `drift` and `miss` and the `session` (the previous
    call's prompt a call sent again and did not resume): the `lever` when those are at least
    the `new_history` (what calls newly appended; `unmatched` of it from calls read without
    their requests, said so), named by the larger; `unverified` when `unknown` tokens (no head
    or session to compare) outnumber the rest; else `not_lever`."""
    counts = (cached, new_history, drift, miss, unknown, session, unmatched)
    names = ("cached", "new_history", "drift", "miss", "unknown", "session", "unmatched")
    for name, n in zip(names, counts, strict=True):
        if type(n) is not int:
            raise ArgumentTypeError(f"judge_lever: {name} is a whole number, not {n!r:.40}")
    if min(counts) < 0:
        return "unverified", "a token count is negative"
    head, uncached = drift + miss, drift + miss + session + new_history + unknown
    if uncached + cached == 0:
        return "unverified", "no call reported prompt and cached counts"
    if unknown > head + session + new_history:
        return "unverified", f"{unknown:,} of {uncached:,} uncached tokens have no head to compare"
    if uncached == 0:
        return "not_lever", f"all {cached:,} prompt tokens came from the cache"
    held = head + session
    if held and held >= new_history:
        if session > head:
            return "lever", (
                f"{session:,} of {uncached:,} uncached tokens were the previous call's prompt "
                f"in the same session, lost before the next call (and {head:,} the head's): "
                "keeping each session warm (keepalive --session) saves them"
            )
        also = f"; {session:,} the session's" if session else ""
        return "lever", (
            f"{head:,} of {uncached:,} uncached tokens were the head (drift {drift:,}, missed "
            f"{miss:,}{also}): keeping it warm and in line saves them"
        )
    if unmatched:
        return "not_lever", (
            f"{new_history:,} of {uncached:,} uncached tokens are history beyond the head, "
            f"{unmatched:,} of them from calls read without their requests (whether those "
            "continued a session is not known; give the requests, or a call log)"
        )
    return "not_lever", (
        f"{new_history:,} of {uncached:,} uncached tokens are new history (each call's newly "
        "appended messages), which no cache holds"
    )

"""The request fields Halogen refuses with a documented 400 (halogen-api.md §1.5). Pure.

- ``top_logprobs`` at all; ``logprobs`` together with ``stream``;
- ``presence_penalty``, ``frequency_penalty``, ``logit_bias`` or ``logprobs`` unless
  ``temperature`` > 0 (absent means 0: decoding is greedy);
- a ``drafter`` the profile does not have (never a silent fallback);
- on Flash, a ``chat_template_kwargs`` key other than ``CHAT_TEMPLATE_KWARGS``, or one that
  contradicts the same top-level field (dense 0.1.x ignores the object).

Messages are ``"<loc>: <msg>"`` like every validation error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixreg.sim.errors import ApiError

__all__ = [
    "CHAT_TEMPLATE_KWARGS",
    "DRAFTERS",
    "check_drafter",
    "check_sampled_only",
    "check_template_kwargs",
    "invalid",
]

DRAFTERS = {"flash": ("serial", "mtp"), "dense": ("serial", "mtp", "dflash2", "ngram")}
# The template switches Flash accepts in `chat_template_kwargs` (0.5.7: three keys) [inferred
# names: the template's own switches among the documented request fields].
CHAT_TEMPLATE_KWARGS = frozenset({"enable_thinking", "preserve_thinking", "reasoning_effort"})
_SAMPLED_ONLY = ("presence_penalty", "frequency_penalty", "logit_bias")


def invalid(loc: str, msg: str) -> ApiError:
    """A 400 validation error at `loc`."""
    return ApiError(400, f"{loc}: {msg}")


def check_sampled_only(body: Mapping[str, Any], stream: bool) -> None:
    if body.get("top_logprobs") is not None:
        raise invalid("body.top_logprobs", "is not supported")
    logprobs = bool(body.get("logprobs"))
    if logprobs and stream:
        raise invalid("body.logprobs", "cannot be combined with stream")
    temperature = body.get("temperature")
    sampled = (
        isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and temperature > 0
    )
    if not sampled:
        for name in (*_SAMPLED_ONLY, *(("logprobs",) if logprobs else ())):
            if body.get(name) is not None:
                raise invalid(
                    f"body.{name}",
                    "needs temperature > 0 (decoding at temperature 0 is greedy)",
                )


def check_drafter(body: Mapping[str, Any], profile: str) -> None:
    drafter = body.get("drafter")
    if drafter is None:
        return
    available = DRAFTERS[profile]
    if not isinstance(drafter, str) or drafter not in available:
        raise invalid(
            "body.drafter",
            f"unknown or unavailable drafter {drafter!r}; available: {', '.join(available)}",
        )


def check_template_kwargs(body: Mapping[str, Any], profile: str) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None or profile != "flash":
        return
    if not isinstance(kwargs, dict):
        raise invalid("body.chat_template_kwargs", "must be an object")
    for key, value in kwargs.items():
        if key not in CHAT_TEMPLATE_KWARGS:
            known = ", ".join(sorted(CHAT_TEMPLATE_KWARGS))
            raise invalid(f"body.chat_template_kwargs.{key}", f"unknown key; known: {known}")
        top = body.get(key)
        if top is not None and top != value:
            raise invalid(
                f"body.chat_template_kwargs.{key}",
                f"conflicts with the top-level {key} ({top!r} != {value!r})",
            )

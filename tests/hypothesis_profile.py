"""The Hypothesis profile the property and fuzz tests share: deterministic and bounded.

`derandomize=True` makes every run try the same examples (CI never flakes on a new seed);
the example and step counts, not wall time, bound the run; no example database is written.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

PROFILE_NAME = "prefixreg-ci"

settings.register_profile(
    PROFILE_NAME,
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=200,
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=False,
)
PROFILE = settings.get_profile(PROFILE_NAME)


def bounded(max_examples: int, **overrides: object) -> settings:
    """The shared profile with a smaller example count for an expensive test."""
    return settings(PROFILE, max_examples=max_examples, **overrides)  # type: ignore[arg-type]

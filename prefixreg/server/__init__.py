"""Talking to workers and judging what they say: the HTTP client with its server profiles,
activity counters, and pure evidence parsing.

Invariant: imports `core` only, never the registry; `server.evidence` does no I/O.
"""

from __future__ import annotations

"""`GatewayConfig`: everything a gateway runs with, checked at the door. Pure.

Invariants:
- At least one worker URL (or a router); every URL in its one canonical spelling
  (`server.urls`: the rule of every other door), http(s) with a host and no user info.
- `on_drift` is `warn` or `refuse`; every `strip` rule compiles as a regex (a bad one is a
  `UsageError` naming it, before anything listens).
- Limits are positive: `max_body_bytes` (a request), `max_reply_bytes` (a buffered reply;
  a stream is forwarded whatever its size, its proof read up to this), `timeout_s` (a whole
  call, connect to last byte), `connect_timeout_s`.
- The client key and the upstream key are held here only; `__repr__` never shows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from prefixreg.core.errors import UsageError
from prefixreg.server.urls import canonical_url, has_userinfo

DEFAULT_LISTEN: Final = "127.0.0.1:8740"
MAX_BODY_BYTES: Final = 64 * 1024 * 1024  # 10 MB of messages pass with room to spare
MAX_REPLY_BYTES: Final = 64 * 1024 * 1024  # the worker client's cap (server.transport)
TIMEOUT_S: Final = 1800.0  # the worker client's read deadline: a cold prefill takes minutes
CONNECT_TIMEOUT_S: Final = 10.0


def check_url(url: object, what: str) -> str:
    """`url` in its one canonical spelling (`server.urls.canonical_url`: the rule every other
    door uses); `UsageError` unless http(s) with a host and without user info."""
    canonical = canonical_url(url, what, keep_userinfo=True)
    if has_userinfo(canonical):
        raise UsageError(f"{what} must not carry user info (use PREFIXREG_API_KEY)")
    return canonical


@dataclass(frozen=True)
class GatewayConfig:
    """A gateway's settings (see the module docstring for what is checked)."""

    workers: tuple[str, ...] = ()
    router: str | None = None
    capacities: tuple[int | None, ...] = ()  # heads each worker keeps (a pool file's capacity)
    placement: tuple[tuple[str, str, str], ...] = ()  # (head sha, worker, routing key): pool's
    on_drift: Literal["warn", "refuse"] = "warn"
    strip: tuple[str, ...] = ()
    register: bool = False
    call_log: Path | None = None
    keep_warm: bool = False
    own_slots: bool = False
    max_body_bytes: int = MAX_BODY_BYTES
    max_reply_bytes: int = MAX_REPLY_BYTES
    timeout_s: float = TIMEOUT_S
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    session_idle_s: float = 600.0
    max_sessions: int = 10_000
    client_key: str | None = field(default=None, repr=False)
    upstream_key: str | None = field(default=None, repr=False)
    registry_root: Path | None = None

    def __post_init__(self) -> None:
        given: object = self.workers
        if not isinstance(given, tuple):
            raise UsageError("workers must be a tuple of URLs")
        workers = tuple(check_url(u, "--worker") for u in self.workers)
        object.__setattr__(self, "workers", workers)
        if self.router is not None:
            object.__setattr__(self, "router", check_url(self.router, "--router"))
        if not workers and self.router is None:
            raise UsageError("a gateway needs --worker URL, --pool FILE or --router URL")
        if self.on_drift not in ("warn", "refuse"):
            raise UsageError(f"--on-drift is warn or refuse, not {self.on_drift!r}")
        for rule in self.strip:
            try:
                re.compile(rule)
            except re.error as exc:
                raise UsageError(f"--strip {rule!r} is not a regex: {exc}") from None
        for name in ("max_body_bytes", "max_reply_bytes", "max_sessions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"{name} must be a whole number above 0")
        for name in ("timeout_s", "connect_timeout_s", "session_idle_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise UsageError(f"{name} must be a number of seconds above 0")

    @property
    def targets(self) -> tuple[str, ...]:
        """Where calls may go: the router alone when there is one, else the workers."""
        return (self.router,) if self.router is not None else self.workers

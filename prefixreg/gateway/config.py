"""`GatewayConfig`: everything a gateway runs with, checked at the door; `from_options` builds
it from the `gateway` command's options (the only part that reads: the environment, a pool file
and its placement). The rest is pure.

Invariants:
- At least one worker URL (or a router); every URL in its one canonical spelling
  (`server.urls`: the rule of every other door), http(s) with a host and no user info.
- `on_drift` is `warn` or `refuse`; every `strip` rule compiles as a regex (a bad one is a
  `UsageError` naming it, before anything listens).
- Limits are positive: `max_body_bytes` (a request), `max_reply_bytes` (a buffered reply;
  a stream is forwarded whatever its size, its proof read up to this), `timeout_s` (a whole
  call, connect to last byte), `connect_timeout_s`.
- The client key and the upstream key are held here only; `__repr__` never shows them.
- `parse_listen` refuses a non-loopback address unless `open_listen` is set and a client
  key is configured; a call log never goes inside the registry (`UsageError`, before
  anything listens).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, cast

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


def parse_listen(text: str, *, open_listen: bool, client_key: str | None) -> tuple[str, int]:
    """(host, port) of `--listen HOST:PORT` (see the invariants)."""
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise UsageError(f"--listen {text!r} is not HOST:PORT", hint="e.g. 127.0.0.1:8740")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise UsageError(f"--listen {text!r}: the host is not an IP address") from None
    if not loopback:
        if not open_listen:
            raise UsageError(
                f"--listen {host} is not a loopback address",
                hint="add --listen-any to open it to the network (a client key is required)",
            )
        if client_key is None:
            raise UsageError("--listen-any needs a client key (--client-key-env NAME)")
    return host, int(port_text)


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

    @classmethod
    def from_options(
        cls,
        *,
        worker: Sequence[str] | None = None,
        pool: Path | None = None,
        router: str | None = None,
        listen: str = DEFAULT_LISTEN,
        listen_any: bool = False,
        register: bool = False,
        on_drift: str = "warn",
        strip: Sequence[str] | None = None,
        call_log: Path | None = None,
        keep_warm: bool = False,
        own_slots: bool = False,
        client_key_env: str | None = None,
        timeout: float = TIMEOUT_S,
        registry: Path | None = None,
        say: Callable[[str], None] = lambda _: None,
    ) -> tuple[GatewayConfig, str, int]:
        """(config, host, port) from the `gateway` command's options, checked in this order:
        --worker or --pool, not both; the client key's variable is set; `parse_listen`; the
        upstream (a pool's workers and placement, `say` given its warnings; else --router);
        the call log outside the registry; then the config's own checks. The upstream key
        comes from $PREFIXREG_API_KEY. Raises `UsageError` naming the option."""
        from prefixreg.registry.location import resolve_registry_path
        from prefixreg.verbs.pool.spec import default_placement, load_placement, pool_spec

        if worker and pool is not None:
            raise UsageError("give --worker URL or --pool FILE, not both")
        client_key = None
        if client_key_env is not None:
            client_key = os.environ.get(client_key_env) or None
            if client_key is None:
                raise UsageError(f"--client-key-env {client_key_env}: the variable is not set")
        host, port = parse_listen(listen, open_listen=listen_any, client_key=client_key)
        root = resolve_registry_path(registry)
        if worker or pool is not None:
            spec = pool_spec(worker or (), pool_file=pool, router=router)
            workers, router_url = tuple(w.url for w in spec.workers), spec.router
            capacities = tuple(w.capacity for w in spec.workers)
            at = spec.placement_path or default_placement(root, spec.pool_id)
            kept, warnings = load_placement(at)  # `prefixreg pool warm`'s: where heads live
            for warning in warnings:
                say(f"warning: {warning}")
            placement = tuple((a.sha256, a.worker, a.key) for a in kept.values())
        elif router is not None:
            workers, router_url, capacities, placement = (), router, (), ()
        else:
            raise UsageError("no upstream", hint="pass --worker URL, --pool FILE or --router URL")
        if call_log is not None:
            _refuse_inside(call_log, root)
        config = cls(
            workers=workers,
            router=router_url,
            capacities=capacities,
            placement=placement,
            on_drift=cast('Literal["warn", "refuse"]', on_drift),  # checked in __post_init__
            strip=tuple(strip or ()),
            register=register,
            call_log=call_log,
            keep_warm=keep_warm,
            own_slots=own_slots,
            timeout_s=timeout,
            client_key=client_key,
            upstream_key=os.environ.get("PREFIXREG_API_KEY") or None,
            registry_root=root,
        )
        return config, host, port


def _refuse_inside(path: Path, root: Path) -> None:
    """A call log never goes inside the registry (DESIGN §5)."""
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except OSError:
        inside = False
    if inside:
        raise UsageError(f"--call-log {path} is inside the registry {root}; refused")

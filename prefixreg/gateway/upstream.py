"""The upstream side: one pooled `httpx.AsyncClient`, the headers a call carries each way, and
which target a call goes to.

Invariants:
- Request headers are the client's, less hop-by-hop ones, `host`, `content-length` and
  `accept-encoding` (the worker is asked for identity bytes, so the bytes the client gets
  are the bytes the worker sent, and the proof reads them as sent). The client's own
  credentials go upstream only when the gateway has no key of its own for the worker
  (`PREFIXREG_API_KEY`) and checks no client key; the upstream key is sent as
  `Authorization: Bearer` and nowhere else.
- Response headers are the worker's, less hop-by-hop ones and `content-length` (the server
  computes it again for the same bytes); `x-prefixreg-*` ones a worker sends are dropped
  (only this gateway speaks in that name).
- Redirects are not followed; environment proxies are not used (the workers are named).
- Choosing a target is `Router.choose`: a session's worker if it has one, else by the
  routing key (the head's sha), else the first; it never fails a call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Final

import httpx

from prefixreg.gateway.config import GatewayConfig

_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
    }
)
_AUTH: Final = frozenset({"authorization", "x-api-key", "api-key"})
PROOF_PREFIX: Final = "x-prefixreg-"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"


def request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, upstream_key: str | None, strip_auth: bool
) -> list[tuple[bytes, bytes]]:
    """The headers to send upstream for a client's raw `headers` (see the invariants)."""
    out: list[tuple[bytes, bytes]] = []
    drop_auth = strip_auth or upstream_key is not None
    for name, value in headers:
        low = name.lower()
        key = low.decode("latin-1")
        if key in _HOP or key.startswith(PROOF_PREFIX) or (drop_auth and key in _AUTH):
            continue
        out.append((low, value))
    out.append((b"accept-encoding", b"identity"))
    if upstream_key is not None:
        out.append((b"authorization", b"Bearer " + upstream_key.encode("latin-1")))
    return out


def response_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The worker's response headers as the client gets them (see the invariants)."""
    out: list[tuple[bytes, bytes]] = []
    for name, value in headers.raw:
        low = name.lower()
        key = low.decode("latin-1")
        if key in _HOP or key.startswith(PROOF_PREFIX):
            continue
        out.append((low, value))
    return out


def make_client(config: GatewayConfig) -> httpx.AsyncClient:
    """The one upstream client: the config's deadlines per read and to connect (a call's
    whole deadline is the app's), a pool big enough for many concurrent streams."""
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    return httpx.AsyncClient(
        timeout=timeout, limits=limits, follow_redirects=False, trust_env=False
    )


class Router:
    """Which target a call goes to: the session's worker, else the routing key's, else the
    first target. With a router in front, always the router (it routes by the key header)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.targets = config.targets
        self.behind_router = config.router is not None
        self._placed: dict[str, str] = {}  # routing key -> worker, for a pool with no router

    def choose(self, *, key: str | None, session_worker: str | None) -> str:
        if self.behind_router or len(self.targets) == 1:
            return self.targets[0]
        if session_worker in self.targets:
            return session_worker
        if key is None:
            return self.targets[0]
        placed = self._placed.get(key)
        if placed is None:
            placed = self._place(key)
            self._placed[key] = placed
        return placed

    def _place(self, key: str) -> str:
        """A new key's worker: the least loaded by keys placed, ties by the key's hash (two
        replicas with the same workers place a key alike when their loads agree)."""
        counts = dict.fromkeys(self.targets, 0)
        for worker in self._placed.values():
            counts[worker] = counts.get(worker, 0) + 1
        least = min(counts.values())
        tied = [t for t in self.targets if counts[t] == least]
        pick = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % len(tied)
        return tied[pick]

    def forget(self, keys: Mapping[str, object]) -> None:
        """Drop placements whose keys are gone (`keys`: the live ones)."""
        for key in [k for k in self._placed if k not in keys]:
            del self._placed[key]

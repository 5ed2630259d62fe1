"""The upstream side: one pooled `httpx.AsyncClient`, the headers a call carries each way, and
which target a call goes to.

Invariants:
- Request headers are the client's, less hop-by-hop ones (and those its `Connection`
  header names), `host`, `content-length` and
  `accept-encoding` (the worker is asked for identity bytes, so the bytes the client gets
  are the bytes the worker sent, and the proof reads them as sent). The client's own
  credentials go upstream only when the gateway has no key of its own for the worker
  (`PREFIXREG_API_KEY`) and checks no client key; the upstream key is sent as
  `Authorization: Bearer` and nowhere else.
- Response headers are the worker's, less hop-by-hop ones (and those its `Connection`
  header names) and `content-length` (the server
  computes it again for the same bytes); `x-prefixreg-*` ones a worker sends are dropped
  (only this gateway speaks in that name).
- Redirects are not followed; environment proxies are not used (the workers are named).
- Choosing a target is `Router.choose`: a session's worker if it has one, else by the
  routing key (the head's sha), else the first; it never fails a call, and its memory is
  bounded (`MAX_PLACED` keys).
"""

from __future__ import annotations

import hashlib
import http.cookiejar
import socket
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

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
        "expect",  # the body is already read whole: nothing is left to continue
    }
)
_AUTH: Final = frozenset({"authorization", "x-api-key", "api-key"})
PROOF_PREFIX: Final = "x-prefixreg-"
ROUTING_KEY_HEADER: Final = "x-smg-routing-key"
MAX_PLACED: Final = 100_000  # routing keys remembered (the least recently used go first)


def _named_in_connection(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[str]:
    """The header names a `Connection` header lists: hop-by-hop for this message only
    (RFC 9110 §7.6.1), so never forwarded."""
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t.strip().lower() for t in value.decode("latin-1").split(","))
    return frozenset(named)


def request_headers(
    headers: Iterable[tuple[bytes, bytes]], *, upstream_key: str | None, strip_auth: bool
) -> list[tuple[bytes, bytes]]:
    """The headers to send upstream for a client's raw `headers` (see the invariants)."""
    out: list[tuple[bytes, bytes]] = []
    drop_auth = strip_auth or upstream_key is not None
    headers = list(headers)
    hop = _HOP | _named_in_connection(headers)
    for name, value in headers:
        low = name.lower()
        key = low.decode("latin-1")
        if key in hop or key.startswith(PROOF_PREFIX) or (drop_auth and key in _AUTH):
            continue
        out.append((low, value))
    out.append((b"accept-encoding", b"identity"))
    if upstream_key is not None:
        out.append((b"authorization", b"Bearer " + upstream_key.encode("latin-1")))
    return out


def response_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    """The worker's response headers as the client gets them (see the invariants)."""
    out: list[tuple[bytes, bytes]] = []
    hop = _HOP | _named_in_connection(headers.raw)
    for name, value in headers.raw:
        low = name.lower()
        key = low.decode("latin-1")
        if key in hop or key.startswith(PROOF_PREFIX):
            continue
        out.append((low, value))
    return out


def make_client(config: GatewayConfig) -> httpx.AsyncClient:
    """The one upstream client: the config's deadlines per read and to connect (a call's
    whole deadline is the app's), a pool big enough for many concurrent streams.

    Its cookie jar never stores: the client is shared by every caller of the gateway, so a
    `Set-Cookie` a worker sent in one caller's reply would otherwise go out with every
    later caller's request (a session cookie crossing tenants). Cookies the client itself
    sends still pass through, as headers."""
    timeout = httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s)
    # An idle pooled connection is dropped after 2 s, well before the 5 s after which
    # llama-server and uvicorn close theirs: a call never races a worker closing its socket.
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256, keepalive_expiry=2.0)
    # TCP_NODELAY: a request's headers and body go out as two writes; with Nagle on, the
    # body waits for the worker's delayed ACK of the headers (tens of milliseconds a call).
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=nodelay)
    jar = http.cookiejar.CookieJar(policy=_NoCookies())
    return httpx.AsyncClient(
        timeout=timeout,
        transport=transport,
        follow_redirects=False,
        trust_env=False,
        cookies=jar,
    )


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    """A cookie policy that stores nothing and sends nothing (see `make_client`)."""

    def set_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False

    def return_ok(self, cookie: http.cookiejar.Cookie, request: Any) -> bool:
        return False


@dataclass
class _Placed:
    worker: str
    calls: int = 0
    last: float = 0.0


class Router:
    """Which target a call goes to: with a router in front, always the router (it routes by
    the key header); else the session's worker, else the worker its head (the routing key)
    was placed on, else a placement: the least loaded worker with room, ties broken by the
    key's hash (two replicas with the same view place a key alike). A head counts against a
    worker's capacity once it returned (two calls) and until it goes idle; a new head that
    finds every worker full is served on the least loaded one and reported `not placed`."""

    def __init__(self, config: GatewayConfig) -> None:
        self.targets = config.targets
        self.behind_router = config.router is not None
        caps = config.capacities or (None,) * len(config.workers)
        self.capacity = dict(zip(config.workers, caps, strict=False))
        self.idle_s = config.session_idle_s
        self._placed: OrderedDict[str, _Placed] = OrderedDict()  # routing key -> placement
        # `prefixreg pool warm`'s placement: where each warmed head lives, and its router key.
        self.pinned = {sha: (w, key) for sha, w, key in config.placement}

    def routing_key(self, sha: str) -> str:
        """The key a router gets for a head: the pool placement's (re-keyed `<sha>.<n>`), else
        the sha itself."""
        pinned = self.pinned.get(sha)
        return pinned[1] if pinned is not None else sha

    def choose(self, *, key: str | None, session_worker: str | None) -> tuple[str, str | None]:
        """(target, placement note or None)."""
        if self.behind_router or len(self.targets) == 1:
            return self.targets[0], None
        pinned = self.pinned.get(key) if key is not None else None
        if pinned is not None and pinned[0] in self.targets:
            return pinned[0], None  # warmed there by `prefixreg pool warm`
        now = time.monotonic()
        placed = self._placed.get(key) if key is not None else None
        if placed is not None and now - placed.last > self.idle_s:
            placed = None
        if session_worker in self.targets and (placed is None or placed.worker == session_worker):
            target, note = session_worker, None
        elif placed is not None:
            target, note = placed.worker, None
        elif key is None:
            return self.targets[0], None
        else:
            target, note = self._place(key, now)
        if key is not None:
            entry = self._placed.get(key)
            if entry is None or entry.worker != target:
                entry = _Placed(target)
            entry.calls += 1
            entry.last = now
            self._placed[key] = entry
            self._placed.move_to_end(key)
            while len(self._placed) > MAX_PLACED:
                self._placed.popitem(last=False)
        return target, note

    def _load(self, now: float) -> dict[str, tuple[int, int]]:
        """Per worker: (heads held: returned and not idle, heads placed and not idle)."""
        held, live = dict.fromkeys(self.targets, 0), dict.fromkeys(self.targets, 0)
        for worker, _ in self.pinned.values():
            if worker in held:
                held[worker] += 1
                live[worker] += 1
        for entry in self._placed.values():
            if now - entry.last <= self.idle_s and entry.worker in held:
                live[entry.worker] += 1
                held[entry.worker] += entry.calls >= 2
        return {t: (held[t], live[t]) for t in self.targets}

    def _place(self, key: str, now: float) -> tuple[str, str | None]:
        load = self._load(now)
        room = [t for t in self.targets if (self.capacity.get(t) or 1 << 30) > load[t][0]]
        pool = room or list(self.targets)
        least = min(load[t] for t in pool)
        tied = [t for t in pool if load[t] == least]
        pick = tied[int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % len(tied)]
        return pick, None if room else "not placed (every worker is at its capacity)"

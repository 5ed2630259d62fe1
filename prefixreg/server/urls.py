"""A worker URL's one canonical spelling: what every door (`Worker`, `--worker`, a pool file,
`PREFIXREG_WORKERS`, `--router`, a placement entry) turns a URL into before using it, so
that one server is one string.

The canonical form is `scheme://host[:port][/path]`: scheme and host lower case, an
IPv4-mapped IPv6 address folded to its IPv4 (`[::ffff:127.0.0.1]` is `127.0.0.1`), an IPv6
address compressed, a host's trailing dot dropped, the port a number, the path with its dot
segments removed (`U/.`, `U/a/..` are `U`), its trailing `/` and one trailing `/v1` dropped.

Refused (`UsageError`, exit 2), with the reason:
- a space, CR, LF or any other control or non-printing character anywhere (Python's URL
  parser silently deletes CR, LF and tab, so `127.0.0.1\\n:P` would pass as another
  spelling);
- a query or fragment (`?`, `#`): a worker URL is a base that paths are joined to, and a
  query would be dropped or glued to every call;
- an unspecified address (`0.0.0.0`, `[::]`): it is the address a server *listens* on. As a
  destination it means "this machine" on Linux and nothing elsewhere, so a pool or placement
  file holding it names a different server on every machine that reads it, and beside
  `127.0.0.1` it is one worker twice. The error names the loopback spelling to use.

Invariants: the result never holds user info unless the caller keeps it (`keep_userinfo`,
the transport's own base); a message never echoes user info.
"""

from __future__ import annotations

import ipaddress
from typing import Final
from urllib.parse import urlsplit, urlunsplit

from prefixreg.core.errors import ArgumentTypeError, UsageError

SHAPE: Final = "http://host:port"
_DOT: Final = frozenset({".", "%2e"})
_DOTDOT: Final = frozenset({"..", ".%2e", "%2e.", "%2e%2e"})


def _safe(text: str) -> str:
    """The URL as shown in an error: no user info (a password), control characters escaped."""
    return repr(text.rpartition("@")[2])[:120]


def _without_dot_segments(path: str) -> str:
    """RFC 3986 §5.2.4 on an absolute path: `.` segments dropped, `..` drops the one before."""
    segments, out = path.split("/"), [""]
    for n, segment in enumerate(segments[1:], start=2):
        last = n == len(segments)
        if segment.lower() in _DOT:
            out += [""] if last else []
        elif segment.lower() in _DOTDOT:
            if len(out) > 1:
                out.pop()
            out += [""] if last else []
        else:
            out.append(segment)
    return "/".join(out)


def _host(hostname: str, prefix: str, shown: str) -> str:
    """The canonical host: an IP address in its one spelling, a name without a trailing dot."""
    try:
        address = ipaddress.ip_address(hostname)
    except ValueError:
        return hostname.removesuffix(".") or hostname
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_unspecified:
        raise UsageError(
            f"{prefix}not a worker URL: {shown} names {address}, the address a server listens "
            "on, not one to reach it at",
            hint="name the worker's host; for this machine http://127.0.0.1:PORT",
        )
    return str(address)


def canonical_url(url: object, where: str = "", *, keep_userinfo: bool = False) -> str:
    """The canonical spelling of worker URL `url` (see the module), or a `UsageError` whose
    message starts with `where: ` (when given) and says why."""
    prefix = f"{where}: " if where else ""
    if not isinstance(url, str):
        raise ArgumentTypeError(f"{prefix}a worker URL is a string, not {type(url).__name__}")
    text = url.strip(" ")
    if any(ch.isspace() or not ch.isprintable() for ch in text):
        raise UsageError(
            f"{prefix}not a worker URL: {_safe(text)} holds a space or a control character"
        )
    if "?" in text or "#" in text:
        raise UsageError(
            f"{prefix}not a worker URL: {_safe(text)} has a query or fragment (?, #); "
            f"a worker URL is {SHAPE}[/path]"
        )
    try:
        parts = urlsplit(text)
        port = parts.port  # raises for a port that is not a number in 1..65535
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0
    except ValueError:
        ok, port = False, None
    if not ok:
        raise UsageError(f"{prefix}not a worker URL ({SHAPE} or https://...): {_safe(text)}")
    host = _host(parts.hostname or "", prefix, _safe(text))
    netloc = f"[{host}]" if ":" in host else host
    netloc = netloc if port is None else f"{netloc}:{port}"
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else None
    if keep_userinfo and userinfo is not None:
        netloc = f"{userinfo}@{netloc}"
    path = _without_dot_segments(parts.path).rstrip("/").removesuffix("/v1").rstrip("/")
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def has_userinfo(url: str) -> bool:
    """Whether `url` (already canonical with `keep_userinfo`) carries user info."""
    return "@" in urlsplit(url).netloc

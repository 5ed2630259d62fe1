"""A model-free, Halogen-compatible worker on loopback that reproduces the prompt cache measured
on the Flash lane: a peer for tests and demos (DESIGN §7), not a way to measure Halogen.

    with SimServer(SimConfig(speed=1000)) as sim:      # 127.0.0.1, ephemeral port
        ...  # talk to sim.url; sim.requests() lists (method, path) received

The server and its stdlib HTTP modules load on first use of `SimServer`, so reading the config
(`prefixreg sim --help`) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixreg.sim.config import PROFILES, SimConfig

if TYPE_CHECKING:
    from prefixreg.sim.engine import API_VERSION
    from prefixreg.sim.server import LoggedRequest, SimServer

__all__ = ["API_VERSION", "PROFILES", "LoggedRequest", "SimConfig", "SimServer"]


def __getattr__(name: str) -> Any:
    if name in ("API_VERSION", "LoggedRequest", "SimServer"):
        from prefixreg.sim import engine, server

        return getattr(engine if name == "API_VERSION" else server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

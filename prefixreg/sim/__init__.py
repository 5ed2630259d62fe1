"""A model-free, Halogen-compatible worker on loopback that reproduces the prompt cache measured
on the Flash lane: a peer for tests and demos (DESIGN §7), not a way to measure Halogen. With
`SimConfig(engine=...)` it answers as vLLM, SGLang, TensorRT-LLM or Ollama (`sim.engines`).
`SimServer` binds 127.0.0.1 on an ephemeral port unless told otherwise; `sim.requests()` lists
the (method, path) it received. The server loads on first use of `SimServer`, so reading the
config (`prefixreg sim --help`) stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixreg.sim.config import PROFILES, SimConfig

if TYPE_CHECKING:
    from prefixreg.sim.server import LoggedRequest, SimServer

__all__ = ["PROFILES", "LoggedRequest", "SimConfig", "SimServer"]


def __getattr__(name: str) -> Any:
    if name not in ("LoggedRequest", "SimServer"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from prefixreg.sim import server

    return getattr(server, name)

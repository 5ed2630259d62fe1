"""A model-free, Halogen-compatible worker on loopback, for tests and demos (DESIGN §7).

It speaks Halogen's HTTP surface (``/health``, ``/cache``, ``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``; streaming, ``stream_options.include_usage``,
``: keepalive``, the OpenAI error envelope) and reproduces the prompt-cache behaviour measured
on the real Flash lane. It is a peer to develop and test against, not a way to measure Halogen.

    from prefixreg.sim import SimConfig, SimServer

    with SimServer(SimConfig(speed=1000)) as sim:      # 127.0.0.1, ephemeral port
        ...  # talk to sim.url; sim.requests() lists (method, path) received

Modules: `tokenizer` (calibrated tokenizer, chat template, answers), `cache` (the LRU, its
wall and counters), `disk` (the disk tier), `timing` (the fitted time model), `config`
(options and measured defaults), `protocol` (validation, response shapes), `engine` (slots,
caches, totals), `bodies` (/health, /cache, /metrics), `server` (HTTP).
"""

from __future__ import annotations

from prefixreg.sim.bodies import API_VERSION
from prefixreg.sim.config import PROFILES, SimConfig
from prefixreg.sim.server import LoggedRequest, SimServer

__all__ = ["API_VERSION", "PROFILES", "LoggedRequest", "SimConfig", "SimServer"]

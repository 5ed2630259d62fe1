"""A model-free, Halogen-compatible worker on loopback, for tests and demos (DESIGN §7).

It speaks Halogen's HTTP surface (``/health``, ``/cache``, ``/v1/models``,
``/v1/chat/completions``, ``/v1/completions``; streaming, ``stream_options.include_usage``,
``: keepalive``, the OpenAI error envelope) and reproduces the prompt-cache behaviour measured
on the real Flash lane. It is a peer to develop and test against, not a way to measure Halogen.

    from prefixreg.sim import SimConfig, SimServer

    with SimServer(SimConfig(speed=1000)) as sim:      # 127.0.0.1, ephemeral port
        ...  # talk to sim.url; sim.requests() lists (method, path) received

Modules: `tokenizer` (tokenizer, chat template, answers), `cache` (the LRU and counters),
`config` (options and measured defaults), `protocol` (validation, response shapes),
`server` (HTTP, slots, timing).
"""

from __future__ import annotations

from prefixreg.sim.config import PROFILES, SimConfig
from prefixreg.sim.server import API_VERSION, LoggedRequest, SimServer

__all__ = ["API_VERSION", "PROFILES", "LoggedRequest", "SimConfig", "SimServer"]

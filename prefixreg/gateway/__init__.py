"""The gateway: an HTTP server a loop points its base URL at (DESIGN §6a), in front of one
worker, a pool or sglang-router. It passes OpenAI chat completions, OpenAI Responses and
Anthropic Messages through byte for byte, sees each request's head, and proves each reply
with the one judge in `x-prefixreg-*` headers, a call log and `/metrics`.

Layering: the top floor beside `prefixreg.cli` (the CLI command imports it lazily); it
stands on `verbs`, `registry`, `server` and `core`, never on the CLI or the simulator.
Starlette and uvicorn (the `gateway` extra) are imported only here.
"""

from __future__ import annotations

from prefixreg.gateway.config import GatewayConfig

__all__ = ["GatewayConfig"]

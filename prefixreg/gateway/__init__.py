"""The gateway: an HTTP server a loop points its base URL at (DESIGN §6a), in front of one
worker, a pool or sglang-router. It passes OpenAI chat completions, OpenAI Responses and
Anthropic Messages through byte for byte, sees each request's head, and proves each reply
with the one judge in `x-prefixreg-*` headers, a call log and `/metrics`.

Layering: the top floor beside `prefixreg.cli` (the CLI command imports it lazily); it
stands on `verbs`, `registry`, `server` and `core`, never on the CLI or the simulator.
Starlette and uvicorn (the `gateway` extra) are imported only here, and only when a gateway
is served (`run_gateway`): without the extra, that is a `UsageError` naming what to install.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixreg.core.errors import UsageError
from prefixreg.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "run_gateway"]


def run_gateway(
    *, ready: Callable[[str], None], say: Callable[[str], None], **options: Any
) -> None:
    """Serve a gateway in the foreground until interrupted: the ASGI stack checked first,
    then `options` (`GatewayConfig.from_options`'s, `say` given its warnings); `ready(url)`
    once it listens."""
    try:
        from prefixreg.gateway.serve import serve
    except ImportError as exc:  # uvicorn or starlette missing: the extra is not installed
        raise UsageError(
            f"prefixreg gateway needs the gateway extra ({exc.name} is not installed)",
            hint="pip install 'prefixreg[gateway]'",
        ) from None
    config, host, port = GatewayConfig.from_options(say=say, **options)
    serve(config, host, port, ready=ready)

"""`prefixreg gateway`: the gateway in the foreground (`prefixreg.gateway`, imported only
when the command runs: `prefixreg --help` loads no ASGI stack)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli import _common as c

Flag = typer.Option


def gateway_command(
    worker: Annotated[
        list[str] | None, Flag(help="A worker URL (repeat for a pool without a router).")
    ] = None,
    pool: Annotated[Path | None, Flag(help="A pool file (as `prefixreg pool` reads it).")] = None,
    router: Annotated[
        str | None,
        Flag(
            help="sglang-router in front of the workers: every call goes there, keyed by its "
            "head's sha in x-smg-routing-key."
        ),
    ] = None,
    listen: Annotated[str, Flag(help="HOST:PORT to listen on (loopback unless --listen-any).")] = (
        "127.0.0.1:8740"
    ),
    listen_any: Annotated[
        bool, Flag(help="Allow a non-loopback --listen address (needs --client-key-env).")
    ] = False,
    register: Annotated[
        bool, Flag(help="Add each unknown head to the registry as a frame (source gateway/API).")
    ] = False,
    on_drift: Annotated[
        str,
        Flag(
            help="warn: forward a call whose head changed and name the drift; refuse: "
            "answer it with the API's own 400 error, nothing forwarded."
        ),
    ] = "warn",
    strip: Annotated[
        list[str] | None,
        Flag(
            help="A regex removed from each head's system text before forwarding (repeat); "
            "e.g. '^x-anthropic-billing-header:.*$'. Matches are counted in /metrics."
        ),
    ] = None,
    call_log: Annotated[
        Path | None, Flag(help="Append one JSON line per call (hashes and counts) for audit.")
    ] = None,
    keep_warm: Annotated[
        bool,
        Flag(
            help="Keep each live session's latest request warm between its calls; on llama.cpp "
            "with slot actions, save its slot after each call and restore it when a foreign "
            "prompt took it."
        ),
    ] = False,
    own_slots: Annotated[
        bool,
        Flag(
            help="llama.cpp: give each live session a slot of its own (id_slot); other "
            "traffic shares the rest. Only when every client comes through the gateway."
        ),
    ] = False,
    client_key_env: Annotated[
        str | None,
        Flag(
            help="The environment variable holding the key clients must send "
            "(Authorization: Bearer or x-api-key)."
        ),
    ] = None,
    timeout: Annotated[
        float, Flag(help="Seconds a call may take, connect to last byte.", min=0.001)
    ] = 1800.0,
    registry: c.RegistryOpt = None,
    debug: c.DebugOpt = False,
) -> None:
    """Serve OpenAI chat completions, OpenAI Responses and Anthropic Messages to any loop, byte
    for byte, in front of one worker, a pool or sglang-router.

    Point the loop's base URL at http://127.0.0.1:8740/v1 (Anthropic clients: the bare URL).
    Each call's head (system text, tools, prompt settings) is hashed as a frame is, named from
    the registry, and the reply proven by the one judge from the server's own counts: headers
    x-prefixreg-verdict, -cached, -head, -reason (streams: -call, then the call log and
    /metrics, or GET /prefixreg/calls/ID). The upstream key comes from PREFIXREG_API_KEY; no
    prompt text or key is logged.
    """
    with c.cli_errors(debug):
        from prefixreg.core.errors import UsageError
        from prefixreg.gateway.config import GatewayConfig

        try:
            from prefixreg.gateway.serve import parse_listen, serve
        except ImportError as exc:  # uvicorn or starlette missing: the extra is not installed
            raise UsageError(
                f"prefixreg gateway needs the gateway extra ({exc.name} is not installed)",
                hint="pip install 'prefixreg[gateway]'",
            ) from None
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
        if worker or pool is not None:
            spec = pool_spec(worker or (), pool_file=pool, router=router)
            workers, router_url = tuple(w.url for w in spec.workers), spec.router
            capacities = tuple(w.capacity for w in spec.workers)
            root = resolve_registry_path(registry)
            at = spec.placement_path or default_placement(root, spec.pool_id)
            kept, warnings = load_placement(at)  # `prefixreg pool warm`'s: where heads live
            for warning in warnings:
                c.info(f"warning: {warning}")
            placement = tuple((a.sha256, a.worker, a.key) for a in kept.values())
        elif router is not None:
            workers, router_url, capacities, placement = (), router, (), ()
        else:
            raise UsageError("no upstream", hint="pass --worker URL, --pool FILE or --router URL")
        root = resolve_registry_path(registry)
        if call_log is not None:
            _refuse_inside(call_log, root)
        config = GatewayConfig(
            workers=workers,
            router=router_url,
            capacities=capacities,
            placement=placement,
            on_drift=on_drift,  # type: ignore[arg-type]  # checked by GatewayConfig
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

        def ready(url: str) -> None:
            c.info(f"prefixreg gateway listening on {url} (base URL {url}/v1)")

        serve(config, host, port, ready=ready)


def _refuse_inside(path: Path, root: Path) -> None:
    """A call log never goes inside the registry (DESIGN §5)."""
    from prefixreg.core.errors import UsageError

    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except OSError:
        inside = False
    if inside:
        raise UsageError(f"--call-log {path} is inside the registry {root}; refused")

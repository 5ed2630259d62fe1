"""`prefixreg gateway`: the gateway in the foreground (`prefixreg.gateway`, imported only
when the command runs: `prefixreg --help` loads no ASGI stack)."""

from __future__ import annotations

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
        from prefixreg.gateway import run_gateway

        run_gateway(
            worker=worker,
            pool=pool,
            router=router,
            listen=listen,
            listen_any=listen_any,
            register=register,
            on_drift=on_drift,
            strip=strip,
            call_log=call_log,
            keep_warm=keep_warm,
            own_slots=own_slots,
            client_key_env=client_key_env,
            timeout=timeout,
            registry=registry,
            say=c.info,
            ready=_ready,
        )


def _ready(url: str) -> None:
    c.info(f"prefixreg gateway listening on {url} (base URL {url}/v1)")

"""`prefixreg sim`: run the Halogen-compatible simulator in the foreground.

One option per `SimConfig` field, from its metadata (`prefixreg.sim.config.knob`): named after
it, typed by its default, with its help and defaults. Options default to None (the profile's
default applies) unless the field names a ``cli_default``; ``env`` names a fallback variable.
Typer builds them with the command, so registering it (`prefixreg --help`) imports no simulator.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import threading
from typing import Annotated, Any

import typer

from prefixreg.cli._common import DebugOpt, cli_errors, info

_HELP = (
    "Run a Halogen-compatible worker simulator in the foreground until Ctrl-C.\n\n"
    "It serves /health, /cache, /metrics, /v1/models, /v1/chat/completions and "
    "/v1/completions on 127.0.0.1 and models the prompt cache measured on the Halogen Flash "
    "lane (API 0.7.0). A peer for demos and tests, not a measurement of Halogen.\n\n"
    "Tokens: calibrated so the probe corpus's 4k/16k/32k/64k-character slices give the "
    "lane's 2,593/11,374/21,337/43,538 prompt tokens (about 1.5 characters a token).\n\n"
    "Time model (fitted to the lane's probe; every duration divided by --speed): the u "
    "uncached tokens of an n-token prompt prefill in min(u x step(n), prefill-setup-s + "
    "u / prefill-tps) seconds, step(n) = step-ms + n/1000 x step-ms-per-kctx milliseconds; "
    "decode takes tokens / decode-tps. Defaults give cold 3.38/9.79/17.06/33.26 s at the four "
    "sizes, an identical repeat 0.16-0.19 s and a fresh tail 0.41-0.47 s (measured: "
    "3.38/9.81/17.16/33.26, 0.12-0.19, 0.4-0.69).\n\n"
    "Wall: a snapshot of t tokens needs t x token-bytes of its slab (cap-mb MiB when set, "
    "else entry-bytes); one the slab cannot take is refused (/cache refused)."
)
_KW = inspect.Parameter.KEYWORD_ONLY
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Do not print a line per request.")]


def _shown(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def option_help(f: dataclasses.Field[Any]) -> str:
    """A field's help text, ending with its default: ``Default: 8 (measured; dense: 3).``"""
    notes = [f.metadata["note"]] if f.metadata["note"] else []
    if "dense" in f.metadata:
        notes.append(f"dense: {_shown(f.metadata['dense'])}")
    shown = f.metadata.get("shown") or _shown(f.metadata.get("cli_default", f.default))
    tail = f" ({'; '.join(notes)})" if notes else ""
    return f"{f.metadata['help']} Default: {shown}{tail}."


def _option(f: dataclasses.Field[Any]) -> inspect.Parameter:
    from prefixreg.sim.config import kind_of

    kind, name = kind_of(f.default), f.name.replace("_", "-")
    decls = f"--{name}/--no-{name}" if kind is bool else f"--{name}"
    option = typer.Option(decls, help=option_help(f), show_default=False)
    default = f.metadata.get("cli_default")
    return inspect.Parameter(
        f.name, _KW, default=default, annotation=Annotated[kind | None, option]
    )


class _SimCommand:
    """The `sim` callback. Typer reads its signature when it builds the command: made from
    `SimConfig` then, not when the command is registered."""

    def __init__(self) -> None:
        self.__annotations__: dict[str, Any] = {}  # typer's hints are in the signature

    @functools.cached_property
    def __signature__(self) -> inspect.Signature:
        from prefixreg.sim.config import SimConfig

        own = [("quiet", QuietOpt), ("debug", DebugOpt)]  # not simulator fields
        params = [inspect.Parameter(name, _KW, default=False, annotation=a) for name, a in own]
        return inspect.Signature([*map(_option, dataclasses.fields(SimConfig)), *params])

    def __call__(self, *, quiet: bool, debug: bool, **options: Any) -> None:
        with cli_errors(debug):
            from prefixreg.sim import SimConfig, SimServer

            for f in dataclasses.fields(SimConfig):
                if "env" in f.metadata and options[f.name] is None:
                    options[f.name] = os.environ.get(f.metadata["env"]) or None
            config = SimConfig.for_profile(options.pop("profile") or "flash", **options)
            server = SimServer(config, log=None if quiet else info)
            auth = ", API key required" if config.api_key else ""
            info(
                f"prefixreg sim ({config.profile}, speed {config.speed:g}{auth}) listening on "
                f"{server.url}  (Ctrl-C to stop)"
            )
            try:
                server.start()
                threading.Event().wait()  # until Ctrl-C
            except KeyboardInterrupt:
                info("stopping")
            finally:
                server.stop()


def register(app: typer.Typer) -> None:
    """Add the `sim` command to `app`."""
    app.command("sim", help=_HELP)(_SimCommand())

"""`prefixreg audit PATH...`: token and time accounting over call outputs.

Exit codes: 0 at least one call was read (malformed files and unverified calls are listed,
not fatal); 2 nothing readable (no path exists, or no call among them) or bad rates;
3 a registry measurement record is corrupt (the store fails closed).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import (
    DebugOpt,
    JsonOpt,
    RegistryOpt,
    cli_errors,
    emit_json,
    info,
    open_registry_from,
)

if TYPE_CHECKING:
    from prefixreg.registry.store import Registry

__all__ = ["audit_command", "register"]


def audit_command(
    paths: Annotated[
        list[Path],
        typer.Argument(
            help="Response JSON files, JSON-lines files, directories (recursive), "
            "or measurement records.",
            metavar="PATH...",
            show_default=False,
        ),
    ],
    prefill_tps: Annotated[
        float | None,
        typer.Option(
            "--prefill-tps",
            help="Prefill rate (tok/s) for calls without server timings "
            "[default: 1180, the measured Halogen Flash lane].",
            show_default=False,
        ),
    ] = None,
    decode_tps: Annotated[
        float | None,
        typer.Option(
            "--decode-tps",
            help="Decode rate (tok/s) for calls without server timings [default: 60].",
            show_default=False,
        ),
    ] = None,
    registry: RegistryOpt = None,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Count prompt, cached and completion tokens over a batch of call outputs, model its
    prefill and decode time, and say which dominates and which registered prefix it shares.
    """
    with cli_errors(debug):
        from prefixreg.core.errors import RegistryLocationError, UsageError
        from prefixreg.verbs.audit import run_audit

        reg: Registry | None
        if registry is not None:
            reg = open_registry_from(registry)
            if not reg.exists:
                raise UsageError(f"{registry}: not a registry")
        else:
            # The default registry only adds names and spans: its absence (or a location
            # that is not one) must not stop an audit of files.
            try:
                reg = open_registry_from(None)
            except RegistryLocationError:
                reg = None
        report = run_audit(
            paths,
            registry=reg if reg is not None and reg.exists else None,
            prefill_tps=prefill_tps,
            decode_tps=decode_tps,
        )
        if not report.calls:
            for m in report.malformed[:10]:
                info(f"{m.source}: {m.reason}")
            raise UsageError(
                "no call outputs read",
                hint="give response JSON, JSON lines, a directory of them, or measurement records",
            )
        if json_out:
            emit_json(report.to_dict())
        else:
            sys.stdout.write(report.to_text())


def register(app: typer.Typer) -> None:
    """Add the `audit` command to `app`."""
    app.command("audit")(audit_command)

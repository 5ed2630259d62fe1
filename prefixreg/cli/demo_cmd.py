"""`prefixreg demo`: add -> warm -> probe on the built-in simulator (`prefixreg.cli.demo`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from prefixreg.cli._common import EXIT_BY_OUTCOME, DebugOpt, JsonOpt, cli_errors, emit_json, info


def demo_command(
    registry: Annotated[
        Path | None,
        typer.Option("--registry", help="Registry to use (default: a fresh temporary directory)."),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(
            "--speed", help="Simulator time compression (1 = the measured lane).", min=0.01
        ),
    ] = 100.0,
    json_out: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show the main job in a minute: start a simulated Halogen worker in-process, add the
    sample system prompt, warm it, prove it resumes, run a short probe, and stop."""
    from prefixreg.cli.demo import run_demo, text_report

    with cli_errors(debug):
        result = run_demo(registry, speed=speed, say=(lambda _m: None) if json_out else info)
        if json_out:
            warm, probe = result.warm.receipt(), result.probe.to_dict()
            emit_json({"registry": str(result.registry), "warm": warm, "probe": probe})
        else:
            sys.stdout.write(text_report(result))
        code = max(EXIT_BY_OUTCOME[result.warm.verdict], EXIT_BY_OUTCOME[result.probe.outcome])
        raise typer.Exit(int(code))


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command("demo")(demo_command)

"""`prefixreg demo`: add -> warm -> probe against the built-in simulator, for newcomers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli._common import EXIT_BY_OUTCOME, DebugOpt, JsonOpt, cli_errors, emit_json, info

if TYPE_CHECKING:
    from prefixreg.cli.demo import DemoResult

__all__ = ["demo_command", "register"]


def _report(result: DemoResult) -> str:
    warm, probe = result.warm, result.probe
    lines = [
        "prefixreg demo: add -> warm -> probe on the built-in Halogen simulator",
        "",
        f"1. add    {warm.prefix.name} {result.sha256[:16]} ({warm.prefix.size:,} bytes)",
    ]
    cold = next((c for c in warm.calls if c.phase == "warm"), None)
    check = warm.check
    if cold is not None and check is not None:
        c_ev, k_ev = cold.evidence, check.evidence
        lines.append(
            f"2. warm   cold call: {c_ev.prompt_tokens:,} prompt tokens, "
            f"{c_ev.cached_tokens} cached, {c_ev.wall_s or 0:.3f} s"
        )
        speedup = ""
        if c_ev.wall_s and k_ev.wall_s:
            speedup = f", {c_ev.wall_s / k_ev.wall_s:.0f}x faster"
        lines.append(
            f"         resume check with a fresh tail: {k_ev.cached_tokens:,} of "
            f"{k_ev.prompt_tokens:,} tokens cached ({k_ev.cached_source}), "
            f"{k_ev.wall_s or 0:.3f} s{speedup}"
        )
        lines.append(f"         verdict: {warm.verdict.upper()} ({warm.reason})")
    status = ", ".join(
        f"{c.number} {c.per_call if c.per_call == c.windowed else c.windowed + f' (lag {c.lag})'}"
        for c in probe.checks
    )
    lines += [
        f"3. probe  Cmax {probe.cmax:,} tokens; a prefix survives {probe.survival} foreign prompts",
        f"         counter checks: {status}",
    ]
    lines += [f"         - {line}" for line in probe.follows()]
    lines += [
        "",
        f"registry {result.registry}",
        f"records  {result.registry / 'measurements'} and {probe.md_path}",
        f"next     prefixreg show {warm.prefix.name} --registry {result.registry}",
    ]
    return "\n".join(lines) + "\n"


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
    from prefixreg.cli.demo import run_demo

    with cli_errors(debug):
        result = run_demo(registry, speed=speed, say=info if not json_out else lambda _m: None)
        if json_out:
            emit_json(
                {
                    "registry": str(result.registry),
                    "warm": result.warm.receipt(),
                    "probe": result.probe.to_dict(),
                }
            )
        else:
            sys.stdout.write(_report(result))
        code = max(EXIT_BY_OUTCOME[result.warm.verdict], EXIT_BY_OUTCOME[result.probe.outcome])
        raise typer.Exit(int(code))


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command("demo")(demo_command)

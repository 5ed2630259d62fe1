"""`prefixreg demo`, for a newcomer: start the simulator in-process on a free loopback port,
add the sample coding-agent system prompt to a registry (a fresh temporary one unless given),
warm it (cold call, then a resume check with a fresh tail), run a short probe, stop.
Everything reported comes from the simulated server's own numbers. The library is imported
inside the functions, so registering the command (`prefixreg --help`) stays cheap.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prefixreg.cli import _common as c

if TYPE_CHECKING:
    from prefixreg.verbs.measure.warm import WarmResult
    from prefixreg.verbs.probe.run import ProbeReport

SAMPLE_NAME = "coding-agent"


def sample_prompt() -> bytes:
    """The sample system prompt: `examples/system-prompt.txt` in a checkout, or its packaged
    copy in an installed wheel."""
    checkout = Path(__file__).resolve().parents[2] / "examples" / "system-prompt.txt"
    if checkout.is_file():
        return checkout.read_bytes()
    return (resources.files("prefixreg") / "_examples" / "system-prompt.txt").read_bytes()


@dataclass(frozen=True, slots=True)
class DemoResult:
    registry: Path
    sha256: str
    warm: WarmResult
    probe: ProbeReport


def run_demo(registry_path: Path | None, *, speed: float, say: Callable[[str], None]) -> DemoResult:
    """Run the demo; `speed` compresses the simulator's modelled time (100 = 100x faster)."""
    from prefixreg.registry.store import Registry
    from prefixreg.server.worker import Worker
    from prefixreg.sim import SimConfig, SimServer
    from prefixreg.verbs.measure.warm import warm
    from prefixreg.verbs.probe.options import ProbeOptions
    from prefixreg.verbs.probe.run import run_probe

    root = registry_path or Path(tempfile.mkdtemp(prefix="prefixreg-demo-")) / "registry"
    reg = Registry(root)
    sha = reg.add(sample_prompt(), name=SAMPLE_NAME, source="examples/system-prompt.txt")
    say(f"added the sample system prompt as {SAMPLE_NAME} ({sha[:16]}) to {root}")
    with SimServer(SimConfig(speed=speed)) as sim, Worker(sim.url) as worker:
        say(f"started the simulated Halogen worker at {sim.url} (Flash lane defaults, x{speed:g})")
        warm_result = warm(reg, reg.head(SAMPLE_NAME), worker)
        say("warmed it and checked that a fresh call resumes it")
        options = ProbeOptions(sizes=(4000, 16000), foreign=9, survival=True)
        report = run_probe(reg, worker, options)
        say("ran a short probe (2 sizes, survival search)")
    return DemoResult(registry=root, sha256=sha, warm=warm_result, probe=report)


def text_report(result: DemoResult) -> str:
    """What each step did, in the simulated server's own numbers."""
    warm, probe = result.warm, result.probe
    lines = [
        "prefixreg demo: add -> warm -> probe on the built-in Halogen simulator",
        "",
        f"1. add    {warm.prefix.name} {result.sha256[:16]} ({warm.prefix.size:,} bytes)",
    ]
    cold = next((c.evidence for c in warm.calls if c.phase == "warm"), None)
    if cold is not None and warm.check is not None:
        check = warm.check.evidence
        speedup = (
            f", {cold.wall_s / check.wall_s:.0f}x faster" if cold.wall_s and check.wall_s else ""
        )
        lines += [
            f"2. warm   cold call: {cold.prompt_tokens:,} prompt tokens, "
            f"{cold.cached_tokens} cached, {cold.wall_s or 0:.3f} s",
            f"         resume check with a fresh tail: {check.cached_tokens:,} of "
            f"{check.prompt_tokens:,} tokens cached ({check.cached_source}), "
            f"{check.wall_s or 0:.3f} s{speedup}",
            f"         verdict: {warm.verdict.upper()} ({warm.reason})",
        ]
    status = ", ".join(
        f"{c.number} {c.per_call if c.per_call == c.windowed else c.windowed + f' (lag {c.lag})'}"
        for c in probe.checks
    )
    lines += [
        f"3. probe  Cmax {probe.cmax:,} tokens; a prefix survives {probe.survival} foreign prompts",
        f"         counter checks: {status}",
        *(f"         - {line}" for line in probe.follows()),
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
    json_out: c.JsonOpt = False,
    debug: c.DebugOpt = False,
) -> None:
    """Show the main job in a minute: start a simulated Halogen worker in-process, add the
    sample system prompt, warm it, prove it resumes, run a short probe, and stop."""
    with c.cli_errors(debug):
        result = run_demo(registry, speed=speed, say=(lambda _m: None) if json_out else c.info)
        if json_out:
            warm, probe = result.warm.receipt(), result.probe.to_dict()
            c.emit_json({"registry": str(result.registry), "warm": warm, "probe": probe})
        else:
            sys.stdout.write(text_report(result))
        code = max(c.EXIT_BY_OUTCOME[result.warm.verdict], c.EXIT_BY_OUTCOME[result.probe.outcome])
        raise typer.Exit(int(code))


def register(app: typer.Typer) -> None:
    """Add `demo` to `app`."""
    app.command("demo")(demo_command)

"""`demo`: the whole main job on an embedded default, for a newcomer.

It starts the simulator in-process on a free loopback port, opens a registry (a fresh
temporary directory unless one is given), adds the sample coding-agent system prompt,
warms it (cold call, then a resume check with a fresh tail), runs a short probe, and stops
the simulator. Everything it reports comes from the simulated server's own numbers.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from prefixreg.registry.store import Registry
from prefixreg.server.worker import Worker
from prefixreg.sim import SimConfig, SimServer
from prefixreg.verbs.measure.warm import WarmResult, warm
from prefixreg.verbs.probe.run import ProbeOptions, ProbeReport, run_probe

__all__ = ["DemoResult", "run_demo", "sample_prompt"]

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


def run_demo(
    registry_path: Path | None = None,
    *,
    speed: float = 100.0,
    say: Callable[[str], None] = lambda _msg: None,
) -> DemoResult:
    """Run the demo; `speed` compresses the simulator's modelled time (100 = 100x faster)."""
    root = registry_path or Path(tempfile.mkdtemp(prefix="prefixreg-demo-")) / "registry"
    reg = Registry(root)
    sha = reg.add(sample_prompt(), name=SAMPLE_NAME, source="examples/system-prompt.txt")
    say(f"added the sample system prompt as {SAMPLE_NAME} ({sha[:16]}) to {root}")
    with SimServer(SimConfig(speed=speed)) as sim:
        say(f"started the simulated Halogen worker at {sim.url} (Flash lane defaults, x{speed:g})")
        with Worker(sim.url) as worker:
            warm_result = warm(reg, reg.head(SAMPLE_NAME), worker)
            say("warmed it and checked that a fresh call resumes it")
            report = run_probe(
                reg, worker, ProbeOptions(sizes=(4000, 16000), foreign=9, survival=True)
            )
            say("ran a short probe (2 sizes, survival search)")
    return DemoResult(registry=root, sha256=sha, warm=warm_result, probe=report)
